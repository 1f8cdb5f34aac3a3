//! Pods in an Istio mesh through the CNI path: which pods istio-cni would capture, Istio's own
//! istio-validation, and taking istio-cni's place in the chain.

use std::time::Duration;

use capture_tests::{
    cni::{pod_status, CgroupDriver, Node},
    injected, istio_validation,
    probe::connect_with,
    topology::{cgroup_programs, POD_CGROUP_HOOKS},
};
use serde_json::json;

use super::from_node;

/// istio-cni's choice of pods (`cni/pkg/plugin/plugin.go` in istio/istio), from the annotations
/// Istio's injector writes: sidecars are captured wherever the proxy container is; a gateway's
/// inbound reaches its own listener; a pod injected with istio-init keeps Istio's own rules.
/// The pods left alone are in `capture status` and the agent's metrics with their reason until
/// their DEL.
#[test]
fn the_pods_istio_cni_captures_and_no_others() {
    let node = Node::new();
    let agent = node.start_agent("ebpf");
    let mut sidecar = node.pod("reviews", CgroupDriver::Systemd, injected::SIDECAR);
    let mut native = node.pod("ratings", CgroupDriver::Cgroupfs, injected::NATIVE_SIDECAR);
    let mut gateway = node.pod("ingressgateway", CgroupDriver::Systemd, injected::GATEWAY);
    let mut init = node.pod("details", CgroupDriver::Cgroupfs, injected::ISTIO_INIT);
    // A status that is not the injector's JSON: istio-cni only asks whether it is there.
    let mut unreadable = node.pod(
        "productpage",
        CgroupDriver::Systemd,
        &[("sidecar.istio.io/status", "injected")],
    );
    for pod in [
        &mut sidecar,
        &mut native,
        &mut gateway,
        &mut init,
        &mut unreadable,
    ] {
        node.add(pod)
            .unwrap_or_else(|e| panic!("ADD {}: {e}", pod.name));
    }
    let _servers: Vec<_> = [&sidecar, &native, &gateway, &init, &unreadable]
        .iter()
        .map(|pod| pod.start_servers())
        .collect();
    for pod in [&sidecar, &native, &unreadable] {
        assert_eq!(
            cgroup_programs(&pod.cgroup).len(),
            POD_CGROUP_HOOKS,
            "{} was not captured",
            pod.name
        );
        let got = from_node(&node, pod.ip(), 8080);
        got.assert_served_by("inbound", "");
        assert_eq!(got.orig(), Some(format!("{}:8080", pod.ip())));
        connect_with(pod.app_client(), &format!("{}:8080", gateway.ip()))
            .assert_served_by("outbound", "");
    }
    for pod in [&gateway, &init] {
        assert!(
            cgroup_programs(&pod.cgroup).is_empty(),
            "{} was captured",
            pod.name
        );
        from_node(&node, pod.ip(), 8080).assert_served_by("app", "");
        connect_with(pod.app_client(), &format!("{}:8080", sidecar.ip()))
            .assert_served_by("inbound", "");
    }
    let reasons = |status: &serde_json::Value| -> Vec<(String, String)> {
        status["left_alone"]
            .as_array()
            .expect("left_alone in status")
            .iter()
            .map(|l| {
                (
                    l["pod"]["name"].as_str().unwrap().to_string(),
                    l["reason"].as_str().unwrap().to_string(),
                )
            })
            .collect()
    };
    let status = node.status();
    let notes = |name: &str| pod_status(&status, name).get("notes").cloned();
    assert_eq!(notes("reviews"), None, "a readable status needs no note");
    let note = notes("productpage").expect("a note on the unreadable status");
    assert!(
        note[0]
            .as_str()
            .is_some_and(|n| n.contains("sidecar.istio.io/status=\"injected\"")),
        "{note}"
    );
    let mut left = reasons(&status);
    left.sort();
    assert_eq!(
        left,
        [
            ("details".to_string(), "istio_init".to_string()),
            ("ingressgateway".to_string(), "gateway".to_string())
        ]
    );
    let metrics = agent.checked_metrics();
    for (pod, reason) in [("details", "istio_init"), ("ingressgateway", "gateway")] {
        let series = format!(
            "capture_pod_left_alone{{namespace=\"{}\",pod=\"{pod}\",reason=\"{reason}\"}} 1",
            init.namespace
        );
        assert!(metrics.contains(&series), "no {series} in\n{metrics}");
    }
    assert!(!metrics.contains("pod=\"reviews\",reason"), "{metrics}");
    for pod in [&sidecar, &native, &gateway, &init, &unreadable] {
        node.check(pod)
            .unwrap_or_else(|e| panic!("CHECK {}: {e}", pod.name));
        node.del(pod).expect("DEL");
    }
    let after = reasons(&node.status());
    assert!(after.is_empty(), "reports outlived their DEL: {after:?}");
}

/// Istio's istio-validation (tools/istio-iptables/pkg/validation/validator.go), which the
/// injector runs as the proxy in every pod when Istio's CNI sets up capture, passes in each pod
/// capture captures through the CNI path under either backend, and fails where capture is not in
/// force: before ADD, and in a gateway, which capture leaves alone as istio-cni does. For IPv4
/// and IPv6-only pods: the validator checks on `::1` and `::6` where the pod's address is IPv6.
#[test]
fn istio_validation_passes_in_every_pod_capture_captures() {
    for (mode, ipv6) in [
        ("ebpf", false),
        ("iptables", false),
        ("ebpf", true),
        ("iptables", true),
    ] {
        let mode_and_family = format!("{mode}, {}", if ipv6 { "IPv6-only" } else { "IPv4" });
        let mode_and_family = mode_and_family.as_str();
        let node = Node::new();
        if ipv6 {
            node.ipv6_only();
        }
        let _agent = node.start_agent(mode);
        let mut pod = node.pod("validated", CgroupDriver::Systemd, injected::SIDECAR);
        let mut gateway = node.pod("gateway", CgroupDriver::Cgroupfs, injected::GATEWAY);
        let before = istio_validation::run_in(&pod, ipv6, Duration::from_secs(1));
        assert!(
            before
                .as_ref()
                .is_err_and(|why| why.contains("validation timeout")),
            "{mode_and_family}: validation before ADD: {before:?}"
        );
        node.add(&mut pod).expect("ADD");
        assert_eq!(
            pod.ip().contains(':'),
            ipv6,
            "{mode_and_family}: {}",
            pod.ip()
        );
        node.add(&mut gateway).expect("ADD gateway");
        istio_validation::run_in(&pod, ipv6, Duration::from_secs(30)).unwrap_or_else(|why| {
            panic!("{mode_and_family}: istio-validation failed in a captured pod: {why}")
        });
        assert!(
            istio_validation::run_in(&gateway, ipv6, Duration::from_secs(1)).is_err(),
            "{mode_and_family}: validation passed in a gateway capture left alone"
        );
        node.del(&pod).expect("DEL");
        node.del(&gateway).expect("DEL gateway");
    }
}

/// A node where istio-cni is chained (its binary is not on this test node, so a runtime that
/// still ran it would fail every ADD): install-cni refuses to chain beside it, takes its place
/// when told to, and uninstall-cni puts it back.
#[test]
fn install_cni_replaces_istio_cni_only_when_told_and_uninstall_puts_it_back() {
    let node = Node::new();
    let file = node.write_network_conflist();
    let mut network: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    let istio_cni = json!({
        "type": "istio-cni",
        "log_level": "info",
        "kubernetes": {"kubeconfig": "/etc/cni/net.d/ZZZ-istio-cni-kubeconfig", "cni_bin_dir": "/opt/cni/bin"},
        "cni_agent_run_dir": "/var/run/istio-cni",
        "exclude_namespaces": ["kube-system"],
        "pod_namespace": "istio-system",
    });
    network["plugins"]
        .as_array_mut()
        .unwrap()
        .push(istio_cni.clone());
    std::fs::write(&file, serde_json::to_string_pretty(&network).unwrap()).unwrap();

    let refused = node.run_install_cni(&[]).unwrap_err();
    assert!(
        refused.contains("istio-cni") && refused.contains("--replace-istio-cni"),
        "{refused}"
    );
    let list = node
        .run_install_cni(&["--replace-istio-cni"])
        .expect("install-cni --replace-istio-cni");
    let types: Vec<&str> = list["plugins"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["type"].as_str().unwrap())
        .collect();
    assert_eq!(types, ["bridge", "capture-cni"], "{list}");
    let _agent = node.start_agent("ebpf");
    let mut pod = node.pod("replaced", CgroupDriver::Systemd, injected::SIDECAR);
    node.add(&mut pod)
        .expect("ADD through the conflist without istio-cni");
    assert_eq!(cgroup_programs(&pod.cgroup).len(), POD_CGROUP_HOOKS);
    node.del(&pod).expect("DEL");

    node.uninstall_cni().expect("uninstall-cni");
    let restored: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(restored, network, "istio-cni back where it was");
}
