//! The iptables backend writes a pod's rules with the node's own iptables variant, nft or
//! legacy: the one whose rules the node's netns holds, as Istio chooses. The pod's record keeps
//! the variant, and its rules are removed with the same one. Real traffic goes through the proxy
//! either way.

use capture_tests::{
    cases::{run_cases, Case, Expect::*},
    guards::{in_netns, run, NetnsGuard},
    probe::Who,
    topology::Topology,
};

/// A node netns whose `variant` tables hold a rule (one that matches nothing: protocol 255), as a
/// node's kube-proxy rules would.
fn node_on(variant: &str) -> NetnsGuard {
    let node = NetnsGuard::new("node");
    run(in_netns(&node.path(), format!("iptables-{variant}"))
        .args(["-A", "INPUT", "-p", "255", "-j", "DROP"]));
    node
}

/// The pod's nat table as `variant` sees it.
fn nat_table(topo: &Topology, variant: &str) -> String {
    topo.nat_table(&format!("iptables-{variant}-save"))
}

fn doctor_variant(topo: &Topology) -> (String, String) {
    let out = topo.capture(&["doctor", "--json"]);
    assert!(out.status.success(), "doctor: {out:?}");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("doctor JSON");
    (
        report["iptables"]["variant"]
            .as_str()
            .unwrap_or_default()
            .into(),
        report["iptables"]["reason"]
            .as_str()
            .unwrap_or_default()
            .into(),
    )
}

fn captured_with(variant: &str, other: &str) {
    let node = node_on(variant);
    let mut topo = Topology::new();
    topo.node_netns = Some(node.path());
    let (chosen, reason) = doctor_variant(&topo);
    assert_eq!(chosen, variant, "doctor: {reason}");
    assert!(reason.contains(&format!("1 {variant} rules")), "{reason}");

    topo.attach(&["--mode", "iptables"]);
    topo.start_all();
    assert!(nat_table(&topo, variant).contains("-A ISTIO_OUTPUT"));
    assert!(
        !nat_table(&topo, other).contains("ISTIO"),
        "no {other} rules in the pod: {}",
        nat_table(&topo, other)
    );
    let status = topo.status();
    assert_eq!(status["pods"][0]["iptables"], variant, "{status}");
    run_cases(
        &topo,
        &[Case::new(
            "captured",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );

    // Removed with the variant that wrote them, whatever the process that removes them sees.
    topo.node_netns = None;
    let out = topo.detach();
    assert!(out.status.success(), "detach: {out:?}");
    assert!(!nat_table(&topo, variant).contains("ISTIO"));
    run_cases(
        &topo,
        &[Case::new(
            "released",
            Who::app(),
            "10.0.0.5:80",
            Remote("10.0.0.5:80"),
        )],
    );
}

#[test]
fn a_node_on_legacy_iptables_gets_legacy_rules_in_its_pods() {
    captured_with("legacy", "nft");
}

#[test]
fn a_node_on_nft_iptables_gets_nft_rules_in_its_pods() {
    captured_with("nft", "legacy");
}

#[test]
fn without_rules_on_the_node_the_unsuffixed_names_decide_unless_overridden() {
    let node = NetnsGuard::new("node");
    let mut topo = Topology::new();
    topo.node_netns = Some(node.path());
    let (chosen, reason) = doctor_variant(&topo);
    assert_eq!(chosen, "plain", "{reason}");
    topo.capture_env
        .push(("CAPTURE_IPTABLES", "legacy".to_string()));
    let (chosen, reason) = doctor_variant(&topo);
    assert_eq!(
        (chosen.as_str(), reason.as_str()),
        ("legacy", "CAPTURE_IPTABLES=legacy")
    );
}
