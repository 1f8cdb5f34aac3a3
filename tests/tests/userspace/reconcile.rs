//! The agent's reconcile with a real containerd: meshed pods that started before capture-cni was
//! chained are captured in place, restarted or reported (`--repair`), a record whose sandbox went
//! while its DEL could not reach capture is released, and an unreadable runtime changes nothing.

use std::time::Duration;

use capture_tests::{
    cni::{Node, MESHED},
    containerd::{Containerd, CriPod, PodSpec},
    kernel::{record_skip, Feature},
    wait::wait_until,
};
use serde_json::Value;

const PATIENCE: Duration = Duration::from_secs(30);

fn spec<'a>(name: &'a str, annotations: &'a [(&'a str, &'a str)]) -> PodSpec<'a> {
    PodSpec {
        name,
        namespace: "default",
        annotations,
        proxy: !annotations.is_empty(),
    }
}

/// The node's network configuration without capture-cni, its runtime, a meshed pod started
/// there (uncaptured) and a plain one; None where runc cannot start containers here.
fn uncaptured_start() -> Option<(Node, Containerd, CriPod, CriPod)> {
    let node = Node::new();
    node.write_network_conflist();
    let runtime = Containerd::start(&node);
    let early = match runtime.run_pod(&spec("early", MESHED)) {
        Ok(pod) => pod,
        Err(e)
            if runtime
                .log_tail()
                .contains("could not ensure we are a cloned binary") =>
        {
            record_skip(
                Feature::RuncClonedBinary,
                "runc cannot re-execute itself here",
            );
            drop(e);
            return None;
        }
        Err(e) => panic!("RunPodSandbox early: {e}\n{}", runtime.log_tail()),
    };
    let other = runtime
        .run_pod(&spec("other", &[]))
        .unwrap_or_else(|e| panic!("RunPodSandbox other: {e}"));
    Some((node, runtime, early, other))
}

fn agent_args<'a>(runtime: &'a Containerd, node_conf: &'a str, repair: &'a str) -> Vec<&'a str> {
    vec![
        "--cri-socket",
        runtime.socket().to_str().unwrap(),
        "--cni-conf-dir",
        node_conf,
        "--reconcile-period",
        "1",
        "--repair",
        repair,
    ]
}

fn captured(node: &Node, pod: &CriPod) -> bool {
    node.status()["pods"].as_array().is_some_and(|pods| {
        pods.iter()
            .any(|p| p["pod"]["container_id"] == pod.id.as_str())
    })
}

/// The agent's last reconcile, once it has made one at least `after` (unix seconds).
fn reconcile_after(node: &Node, after: u64) -> Value {
    wait_until(PATIENCE, "a reconcile pass", || {
        let report = node.status()["reconcile"].clone();
        if report["at_unix"].as_u64().is_some_and(|at| at > after) {
            Ok(report)
        } else {
            Err(report.to_string())
        }
    })
}

fn now_unix() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs()
}

#[test]
fn a_meshed_pod_started_before_capture_is_captured_in_place_and_a_lost_del_is_released() {
    let Some((node, runtime, early, other)) = uncaptured_start() else {
        return;
    };
    // A meshed pod of an excluded namespace, started uncaptured too: never the reconcile's.
    let system = runtime
        .run_pod(&PodSpec {
            namespace: "kube-system",
            ..spec("system", MESHED)
        })
        .expect("RunPodSandbox system");
    node.run_install_cni(&[]).expect("install-cni");
    let conf = node.conf_dir();
    let conf = conf.to_str().unwrap();
    let mut agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "capture"));
    wait_until(PATIENCE, "the early pod captured by the reconcile", || {
        if captured(&node, &early) {
            Ok(())
        } else {
            Err(node.status()["reconcile"].to_string())
        }
    });
    // Its outbound connections go through its proxy, and its proxy's listener was adopted: a
    // connection to the pod lands on the proxy's inbound port.
    let got = runtime.connect_from(&early, "app", &format!("{}:8080", other.ip));
    got.assert_served_by("outbound", "the repaired pod's app");
    assert_eq!(got.orig(), Some(format!("{}:8080", other.ip)));
    let got = runtime.connect_from(&other, "app", &format!("{}:8080", early.ip));
    got.assert_served_by("inbound", "a connection to the repaired pod");
    let metrics = agent.checked_metrics();
    assert!(
        metrics.contains("capture_repairs_total{action=\"capture\",result=\"ok\"} 1"),
        "{metrics}"
    );
    assert!(
        !captured(&node, &other) && !captured(&node, &system),
        "an unmeshed pod and a kube-system pod are never touched"
    );

    // A DEL that cannot reach capture: the pod goes while capture-cni is not chained.
    agent.stop();
    node.uninstall_cni().expect("uninstall-cni");
    runtime.remove_pod(&early).expect("RemovePodSandbox");
    assert!(captured(&node, &early), "the record outlives its sandbox");
    node.run_install_cni(&[]).expect("install-cni");
    let _agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "capture"));
    wait_until(PATIENCE, "the orphan record released", || {
        if captured(&node, &early) {
            Err(node.status()["reconcile"].to_string())
        } else {
            Ok(())
        }
    });
    // A meshed pod created now is captured by its ADD, and works.
    let next = runtime
        .run_pod(&spec("next", MESHED))
        .expect("RunPodSandbox next");
    assert!(captured(&node, &next));
    let got = runtime.connect_from(&next, "app", &format!("{}:8080", other.ip));
    got.assert_served_by("outbound", "the next pod's app");
    for pod in [&next, &other, &system] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
}

#[test]
fn report_changes_nothing_an_unreadable_runtime_changes_nothing_and_restart_stops_the_sandbox() {
    let Some((node, runtime, early, other)) = uncaptured_start() else {
        return;
    };
    node.run_install_cni(&[]).expect("install-cni");
    let conf = node.conf_dir();
    let conf = conf.to_str().unwrap();

    let start = now_unix();
    let mut agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "report"));
    let report = reconcile_after(&node, start);
    let uncaptured = report["uncaptured"].as_array().expect("uncaptured");
    assert_eq!(uncaptured.len(), 1, "{report:#}");
    assert_eq!(uncaptured[0]["pod"], "default/early", "{report:#}");
    assert_eq!(uncaptured[0]["action"], "report", "{report:#}");
    assert!(!captured(&node, &early));
    let metrics = agent.checked_metrics();
    assert!(metrics.contains("capture_pods_uncaptured 1"), "{metrics}");
    assert!(metrics.contains("capture_runtime_reachable 1"), "{metrics}");
    agent.stop();

    let start = now_unix();
    let mut agent = node.start_agent_with(
        "ebpf",
        &[
            "--cri-socket",
            "/nonexistent/cri.sock",
            "--reconcile-period",
            "1",
        ],
    );
    let report = reconcile_after(&node, start);
    assert!(
        report["runtime_error"]
            .as_str()
            .is_some_and(|e| e.contains("/nonexistent/cri.sock")),
        "{report:#}"
    );
    assert!(agent
        .checked_metrics()
        .contains("capture_runtime_reachable 0"));
    assert!(!captured(&node, &early), "nothing changed");
    agent.stop();

    let _agent = node.start_agent_with("ebpf", &agent_args(&runtime, conf, "restart"));
    wait_until(PATIENCE, "the early sandbox stopped", || {
        let pods = runtime.cri().list_pods().map_err(|e| e.to_string())?;
        let state = pods.iter().find(|p| p.id == early.id).map(|p| p.state);
        if state == Some(k8s_cri::v1::PodSandboxState::SandboxNotready as i32) {
            Ok(())
        } else {
            Err(format!("{state:?}"))
        }
    });
    assert!(!captured(&node, &early), "restart captures nothing itself");
    for pod in [&early, &other] {
        runtime.remove_pod(pod).expect("RemovePodSandbox");
    }
}
