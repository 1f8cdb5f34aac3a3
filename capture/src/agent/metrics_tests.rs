use std::{
    path::PathBuf,
    sync::{Arc, Mutex},
};

use capture_common::config::PodCounters;

use super::*;
use crate::{
    config::{CaptureConfig, FallbackCause, PodSpec},
    ops::{NodeStatus, PodStatus},
    record::{PodRecord, PodRef},
};

fn check(name: &str, ok: bool, optional: bool) -> Check {
    Check {
        name: name.into(),
        ok,
        detail: String::new(),
        optional,
    }
}

fn pod(name: &str, mode: Mode, fallback: Option<&str>, counters: Option<PodCounters>) -> PodStatus {
    let spec = PodSpec::of_annotations(&["10.88.0.7"], &[]);
    PodStatus {
        record: PodRecord {
            netns_cookie: 7,
            netns: PathBuf::from(format!("/var/run/netns/{name}")),
            cgroup: PathBuf::from("/sys/fs/cgroup/kubepods/pod1"),
            mode,
            annotations: std::collections::BTreeMap::default(),
            config: CaptureConfig::from_pod(&spec).unwrap(),
            attached_at_unix: 0,
            pod: Some(PodRef {
                namespace: "default".into(),
                name: name.into(),
                uid: "uid".into(),
                container_id: "sandbox".into(),
            }),
            fallback_reason: fallback.map(Into::into),
            fallback_cause: fallback.map(|_| FallbackCause::Tproxy),
            release_failed: None,
            iptables: None,
            settings: Vec::new(),
            proxy_container: None,
            proxy_settings_refused: None,
        },
        in_force: true,
        missing: Vec::new(),
        program_build: (mode == Mode::Ebpf).then(|| "0.1.0+0123456789ab".into()),
        loopback_destinations: (mode == Mode::Ebpf).then_some(3),
        acceleration: None,
        notes: Vec::new(),
        counters,
    }
}

fn node(pods: Vec<PodStatus>) -> NodeStatus {
    NodeStatus {
        bpffs: "/sys/fs/bpf/capture".into(),
        state_dir: "/run/capture".into(),
        programs_loaded: true,
        build: "0.1.0+0123456789ab".into(),
        node_build: Some("0.1.0+0123456789ab".into()),
        node_features: None,
        pods,
        damaged_records: Vec::new(),
        node_errors: [("unknown_pod", 3), ("handoff_failed", 0)].into(),
        trace: Some(crate::trace::NodeTrace {
            traced_pods: 1,
            emitted: 40,
            dropped: 2,
            sessions: Vec::new(),
        }),
        pending_handoffs: 0,
        left_alone: Vec::new(),
        mesh_config: None,
        mesh_configs: Vec::new(),
        cni_chain: None,
        runtime: None,
        reconcile: None,
    }
}

#[test]
fn the_agents_own_metrics_keep_their_names_and_labels() {
    let checks = [
        check("cgroup v2", true, false),
        check("program cgroup/sendmsg4", false, true),
    ];
    let m = Metrics::new(Mode::Ebpf, &checks, Box::new(|| None));
    m.set_ready(true);
    m.count_request("add", true);
    m.count_request("add", true);
    m.count_request("del", false);
    m.observe_attach(Duration::from_millis(3));
    let started = |ago: Duration| {
        let now = api::plugin_clock_ns().expect("CLOCK_BOOTTIME");
        Some(now - u64::try_from(ago.as_nanos()).unwrap())
    };
    let captured = Response {
        mode: Some(Mode::Iptables),
        ..Response::ok("captured")
    };
    m.observe_cni_add(Mode::Ebpf, &captured, started(Duration::from_millis(3)));
    let refused = Response::failed(FailureKind::NotReady, "not ready");
    m.observe_cni_add(Mode::Ebpf, &refused, started(Duration::from_millis(1)));
    // Not the plugin's (no start told), and a start on another clock: neither is an ADD.
    m.observe_cni_add(Mode::Ebpf, &captured, None);
    m.observe_cni_add(Mode::Ebpf, &captured, started(Duration::from_hours(2)));
    let text = m.encode().unwrap();
    for line in [
        "# TYPE capture_kernel_check gauge",
        "capture_kernel_check{check=\"cgroup v2\",optional=\"false\"} 1",
        "capture_kernel_check{check=\"program cgroup/sendmsg4\",optional=\"true\"} 0",
        "capture_mode{mode=\"ebpf\"} 1",
        "capture_mode{mode=\"iptables\"} 0",
        "# TYPE capture_agent_ready gauge",
        "capture_agent_ready 1",
        "# HELP capture_agent_requests_total Requests served on the agent socket, by operation and result.",
        "# TYPE capture_agent_requests_total counter",
        "capture_agent_requests_total{op=\"add\",result=\"ok\"} 2",
        "capture_agent_requests_total{op=\"del\",result=\"error\"} 1",
        "# TYPE capture_attach_duration_seconds histogram",
        "capture_attach_duration_seconds_bucket{le=\"0.0025\"} 0",
        "capture_attach_duration_seconds_bucket{le=\"0.005\"} 1",
        "capture_attach_duration_seconds_bucket{le=\"2.5\"} 1",
        "capture_attach_duration_seconds_bucket{le=\"+Inf\"} 1",
        "capture_attach_duration_seconds_count 1",
        "# TYPE capture_cni_add_duration_seconds histogram",
        // At least the 3 ms it started before; the bound above depends on the machine.
        "capture_cni_add_duration_seconds_bucket{mode=\"iptables\",result=\"ok\",le=\"0.0025\"} 0",
        "capture_cni_add_duration_seconds_bucket{mode=\"iptables\",result=\"ok\",le=\"+Inf\"} 1",
        "capture_cni_add_duration_seconds_count{mode=\"iptables\",result=\"ok\"} 1",
        "capture_cni_add_duration_seconds_count{mode=\"ebpf\",result=\"not_ready\"} 1",
        // The agent's own mode's captures, there before the first of them.
        "capture_cni_add_duration_seconds_count{mode=\"ebpf\",result=\"ok\"} 0",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing from\n{text}");
    }
    assert_eq!(
        text.matches("capture_attach_duration_seconds_bucket{")
            .count(),
        LATENCY_BUCKETS.len() + 1,
        "{text}"
    );
    assert!(
        !text
            .lines()
            .any(|l| l.starts_with("capture_pods ") || l.starts_with("capture_pod_")),
        "no node, no node series: {text}"
    );
    for reconcile in [
        "# TYPE capture_pods_uncaptured gauge",
        "# TYPE capture_runtime_reachable gauge",
    ] {
        assert!(
            text.lines().any(|l| l == reconcile),
            "{reconcile} missing from\n{text}"
        );
    }
    assert!(!text.contains("..") && !text.contains("# EOF"), "{text}");
}

#[test]
fn pod_series_are_read_at_each_scrape() {
    let counters = PodCounters {
        redirected_outbound: 5,
        errors: 1,
        ..PodCounters::default()
    };
    // How many of the two pods are captured, as the node's records would say.
    let captured = Arc::new(Mutex::new(3));
    let shared = Arc::clone(&captured);
    let read = Box::new(move || {
        let mut older = pod("older", Mode::Iptables, Some("fell back"), None);
        // A record written before the cause was kept.
        older.record.fallback_cause = None;
        let mut pods = vec![
            pod("web", Mode::Ebpf, None, Some(counters)),
            pod(
                "legacy",
                Mode::Iptables,
                Some("needs \"TPROXY\"\nmarks"),
                None,
            ),
            older,
        ];
        pods.truncate(*shared.lock().unwrap());
        Some(node(pods))
    });
    let m = Metrics::new(Mode::Ebpf, &[], read);

    let text = m.encode().unwrap();
    let web = "namespace=\"default\",pod=\"web\",netns=\"/var/run/netns/web\",mode=\"ebpf\"";
    let legacy =
        "namespace=\"default\",pod=\"legacy\",netns=\"/var/run/netns/legacy\",mode=\"iptables\"";
    let older =
        "namespace=\"default\",pod=\"older\",netns=\"/var/run/netns/older\",mode=\"iptables\"";
    for line in [
        "capture_pods 3".to_string(),
        format!("capture_pod_in_force{{{web}}} 1"),
        format!("capture_pod_in_force{{{legacy}}} 1"),
        format!("capture_pod_fallback{{{legacy},cause=\"tproxy\"}} 1"),
        format!("capture_pod_fallback{{{older},cause=\"unknown\"}} 1"),
        format!("capture_pod_loopback_destinations{{{web}}} 3"),
        "# TYPE capture_pod_connections_total counter".to_string(),
        format!("capture_pod_connections_total{{{web},decision=\"redirected_outbound\"}} 5"),
        format!("capture_pod_connections_total{{{web},decision=\"error\"}} 1"),
        "# TYPE capture_kernel_errors_total counter".to_string(),
        "capture_kernel_errors_total{kind=\"unknown_pod\"} 3".to_string(),
        "capture_kernel_errors_total{kind=\"handoff_failed\"} 0".to_string(),
        "capture_traced_pods 1".to_string(),
        "capture_trace_events_total{result=\"emitted\"} 40".to_string(),
        "capture_trace_events_total{result=\"dropped\"} 2".to_string(),
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line} missing from\n{text}"
        );
    }
    assert_eq!(text.matches("capture_pod_fallback{").count(), 2, "{text}");
    assert!(
        !text.contains("TPROXY"),
        "a reason's words are no label value: {text}"
    );
    assert_eq!(
        text.matches("capture_pod_connections_total{").count(),
        10,
        "only the ebpf pod has counters: {text}"
    );

    // A released pod's series go with it at the next scrape.
    *captured.lock().unwrap() = 1;
    let text = m.encode().unwrap();
    assert!(text.lines().any(|l| l == "capture_pods 1"), "{text}");
    assert!(!text.contains("pod=\"legacy\""), "{text}");
    assert!(!text.contains("capture_pod_fallback"), "{text}");
}
