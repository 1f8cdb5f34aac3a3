//! A pod with a user namespace of its own (Kubernetes `hostUsers: false`): its proxy's 1337 is
//! another uid on the node. Under both backends the app is captured and the proxy's own traffic
//! is not: iptables because its rules are written from inside the pod's user namespace (the only
//! writer the kernel accepts an owner match from), ebpf because the ids are translated at attach.

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect::*},
    probe::Who,
    topology::Topology,
};

/// The node's view of the pod's id 0.
const OUTER_BASE: u32 = 200_000;

#[test]
fn the_proxy_inside_a_user_namespace_is_exempt_and_the_app_captured() {
    for backend in Backend::EVERY.into_iter().filter(|b| b.wanted()) {
        let mut topo = Topology::with_pod_userns(OUTER_BASE);
        topo.attach(&["--mode", backend.mode()]);
        topo.start_all();
        run_cases_on(
            &topo,
            Some(backend),
            &[
                Case::new("app", Who::app(), "10.0.0.5:80", Outbound("10.0.0.5:80")),
                Case::new(
                    "app v6",
                    Who::app(),
                    "[fd00:2::5]:80",
                    Outbound("[fd00:2::5]:80"),
                ),
                Case::new("proxy", Who::proxy(), "10.0.0.5:80", Remote("10.0.0.5:80")),
                Case::new(
                    "proxy v6",
                    Who::proxy(),
                    "[fd00:2::5]:80",
                    Remote("[fd00:2::5]:80"),
                ),
                // The node's uid 1337 is nobody in particular inside the pod: captured.
                Case::new(
                    "inside uid 1337 only by the node's count",
                    Who::new(1337 - 1000, 1337 - 1000),
                    "10.0.0.5:80",
                    Outbound("10.0.0.5:80"),
                ),
            ],
        );
        let inbound = topo.connect_from_remote(&format!("{}:8080", topo.ip4));
        inbound.assert_served_by("inbound", backend.mode());
        let status = topo.status();
        let host_ids = &status["pods"][0]["config"]["host_ids"];
        assert_eq!(
            host_ids["proxy_uids"],
            serde_json::json!([OUTER_BASE + 1337]),
            "{backend:?}: the record keeps the proxy's uid as the node sees it: {status}"
        );
    }
}

#[test]
fn a_proxy_id_the_pod_cannot_map_is_refused() {
    for backend in Backend::EVERY.into_iter().filter(|b| b.wanted()) {
        let topo = Topology::with_pod_userns(OUTER_BASE);
        let out = topo.try_attach(&["--mode", backend.mode(), "--proxy-uid", "70000"]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{backend:?}: attach succeeded");
        assert!(
            err.contains("uid 70000") && err.contains("uid_map"),
            "{backend:?}: the error names the id and the map: {err}"
        );
        assert_eq!(
            topo.status()["pods"].as_array().map_or(0, Vec::len),
            0,
            "{backend:?}: a record was left"
        );
    }
}
