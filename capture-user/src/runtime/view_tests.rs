//! Which sandboxes `node_view` calls meshed, captured or not, and which records it calls orphans.

use std::{collections::BTreeMap, path::PathBuf};

use super::{view::*, Sandbox};
use crate::{
    cni::PluginConfig,
    config::{CaptureConfig, PodSpec},
    record::{Mode, PodRecord, PodRef},
};

const INJECTED: &str =
    r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":[]}"#;

fn sandbox(ns: &str, name: &str, annotations: &[(&str, &str)]) -> Sandbox {
    Sandbox {
        id: format!("sb-{name}"),
        namespace: ns.into(),
        name: name.into(),
        uid: format!("uid-{name}"),
        ready: true,
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        labels: BTreeMap::new(),
        host_network: false,
        netns: Some(PathBuf::from(format!("/var/run/netns/{name}"))),
        ips: vec!["10.1.0.10".parse().unwrap()],
        unreadable: Vec::new(),
    }
}

fn meshed(ns: &str, name: &str) -> Sandbox {
    sandbox(ns, name, &[("sidecar.istio.io/status", INJECTED)])
}

fn record(name: &str, container_id: Option<&str>) -> PodRecord {
    let spec = PodSpec::of_annotations(&["10.1.0.10"], &[]);
    PodRecord {
        netns_cookie: 7,
        netns: PathBuf::from(format!("/var/run/netns/{name}")),
        cgroup: PathBuf::from("/sys/fs/cgroup/kubepods/pod1"),
        mode: Mode::Ebpf,
        annotations: BTreeMap::new(),
        config: CaptureConfig::from_pod(&spec).unwrap(),
        attached_at_unix: 0,
        pod: container_id.map(|id| PodRef {
            namespace: "shop".into(),
            name: name.into(),
            uid: format!("uid-{name}"),
            container_id: id.into(),
        }),
        fallback_reason: None,
        fallback_cause: None,
        release_failed: None,
        iptables: None,
        settings: Vec::new(),
        proxy_container: None,
        proxy_settings_refused: None,
    }
}

fn standing<'v>(view: &'v NodeView, pod: &str) -> &'v SandboxView {
    view.sandboxes
        .iter()
        .find(|s| s.pod == pod)
        .unwrap_or_else(|| panic!("no {pod} in {view:#?}"))
}

#[test]
fn a_meshed_sandbox_without_a_record_runs_uncaptured() {
    let sandboxes = [meshed("shop", "web"), meshed("shop", "cart")];
    let records = [record("web", Some("sb-web"))];
    let view = node_view(&sandboxes, &records, &PluginConfig::default());
    let web = standing(&view, "shop/web");
    assert_eq!(
        (web.standing, web.captured),
        (Standing::Captured, Some(Mode::Ebpf))
    );
    let cart = standing(&view, "shop/cart");
    assert_eq!(cart.standing, Standing::MeshedNotCaptured);
    assert!(cart.meshed && cart.captured.is_none());
    assert!(cart
        .why
        .as_deref()
        .is_some_and(|w| w.contains("no CNI ADD")));
    assert_eq!(view.uncaptured().count(), 1);
    assert!(view.orphans.is_empty());
}

#[test]
fn unmeshed_excluded_gateway_and_host_network_sandboxes_are_not_meshed() {
    let mut host = meshed("shop", "host");
    host.host_network = true;
    let sandboxes = [
        sandbox("shop", "plain", &[]),
        meshed("kube-system", "dns"),
        sandbox(
            "shop",
            "gateway",
            &[
                ("sidecar.istio.io/status", INJECTED),
                ("inject.istio.io/templates", "gateway"),
            ],
        ),
        sandbox(
            "shop",
            "optout",
            &[
                ("sidecar.istio.io/status", INJECTED),
                ("sidecar.istio.io/inject", "false"),
            ],
        ),
        host,
    ];
    let view = node_view(&sandboxes, &[], &PluginConfig::default());
    for pod in [
        "shop/plain",
        "kube-system/dns",
        "shop/gateway",
        "shop/optout",
    ] {
        let s = standing(&view, pod);
        assert_eq!(s.standing, Standing::NotMeshed, "{s:#?}");
        assert!(!s.meshed && s.why.is_some(), "{s:#?}");
    }
    assert!(standing(&view, "kube-system/dns")
        .why
        .as_deref()
        .is_some_and(|w| w.contains("kube-system is excluded")));
    assert_eq!(standing(&view, "shop/host").standing, Standing::HostNetwork);
    assert_eq!(view.uncaptured().count(), 0);
}

#[test]
fn a_record_without_its_sandbox_is_an_orphan_and_a_cli_capture_matches_by_netns() {
    let mut not_ready = meshed("shop", "leaving");
    not_ready.ready = false;
    let sandboxes = [meshed("shop", "cli"), not_ready];
    let records = [
        record("gone", Some("sb-gone")),
        record("cli", None),
        // Captured with the CLI alone, and no sandbox's: never an orphan.
        record("test-netns", None),
    ];
    let view = node_view(&sandboxes, &records, &PluginConfig::default());
    assert_eq!(standing(&view, "shop/cli").standing, Standing::Captured);
    assert_eq!(
        standing(&view, "shop/leaving").standing,
        Standing::MeshedNotReady
    );
    assert_eq!(view.orphans.len(), 1, "{view:#?}");
    assert_eq!(view.orphans[0].container_id, "sb-gone");
    assert_eq!(view.orphans[0].sandbox, OrphanSandbox::Gone);
}

#[test]
fn a_record_of_a_stopped_sandbox_is_an_orphan_and_of_a_ready_one_is_not() {
    let mut stopped = meshed("shop", "stopped");
    stopped.ready = false;
    let sandboxes = [meshed("shop", "running"), stopped];
    let records = [
        record("running", Some("sb-running")),
        record("stopped", Some("sb-stopped")),
    ];
    let view = node_view(&sandboxes, &records, &PluginConfig::default());
    assert_eq!(view.orphans.len(), 1, "{view:#?}");
    assert_eq!(view.orphans[0].container_id, "sb-stopped");
    assert_eq!(view.orphans[0].sandbox, OrphanSandbox::Stopped);
}
