//! Proxy identity's bookkeeping, on the CLI: what attach refuses and why (the iptables backend,
//! a fallback that would weaken it, bad values, a proxy cgroup that is not the pod's), and a
//! pod's own proxy uid, honoured only where the annotation policy allows it. The kernel side is
//! the hooks tier's (`hooks/proxy_identity.rs`), which every kernel of the matrix runs.

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect},
    guards::{output_text, TempFile},
    probe::Who,
    topology::Topology,
};

const REMOTE: &str = "10.0.0.5:80";

#[test]
fn proxy_identity_bad_input_is_refused_and_named() {
    let topo = Topology::new();
    let proxy = topo.pod.cgroup.child("istio-proxy");
    let elsewhere = capture_tests::guards::CgroupGuard::new("capture-not-the-pod");
    let refused = |extra: &[&str], says: &[&str]| {
        let out = topo.try_attach(extra);
        let text = output_text(&out);
        assert!(!out.status.success(), "{extra:?} was accepted: {text}");
        for s in says {
            assert!(text.contains(s), "{extra:?}: {s:?} not in {text}");
        }
    };
    refused(
        &["--mode", "iptables", "--proxy-identity", "container"],
        &["needs the ebpf backend"],
    );
    // auto falls back to iptables for TPROXY; under identity by container it must not.
    refused(
        &[
            "--mode",
            "auto",
            "--proxy-identity",
            "container",
            "--annotation",
            "sidecar.istio.io/interceptionMode=TPROXY",
        ],
        &["falling back to iptables would drop"],
    );
    refused(
        &["--annotation", "capture.dev/proxy-identity=pod"],
        &["capture.dev/proxy-identity", "\"pod\"", "container or uid"],
    );
    let proxy_path = proxy.path.to_str().unwrap();
    refused(
        &["--proxy-cgroup", proxy_path],
        &["--proxy-identity container"],
    );
    refused(
        &[
            "--proxy-identity",
            "container",
            "--proxy-cgroup",
            elsewhere.path.to_str().unwrap(),
        ],
        &["not below the pod's cgroup"],
    );
    assert!(
        topo.status()["pods"].as_array().is_none_or(Vec::is_empty),
        "a refused attach records nothing"
    );
    // The pod's own annotation opts in where the node's default is uid.
    topo.attach(&[
        "--annotation",
        "capture.dev/proxy-identity=container",
        "--proxy-cgroup",
        proxy_path,
    ]);
    assert_eq!(topo.proxy_identity()["proxy"]["state"], "known");
}

#[test]
fn a_pods_own_proxy_uid_needs_the_policy_and_stays_with_its_proxy_container() {
    const OPENSHIFT_UID: u32 = 1_000_680_000;
    let policy = TempFile::new(
        "policy.yaml",
        r#"
rules:
- name: openshift-uids
  annotations:
    capture.dev/proxy-uid: {ids: ["1000680000-1000689999"]}
    traffic.sidecar.istio.io/excludeOutboundIPRanges: {within: [10.96.0.0/12]}
"#,
    );
    let mut topo = Topology::new();
    let proxy = topo.pod.cgroup.child("istio-proxy");
    let app = topo.pod.cgroup.child("app");
    topo.start_all();
    let policy_path = policy.path.to_str().unwrap();
    let own_uid = format!("capture.dev/proxy-uid={OPENSHIFT_UID}");

    let out = topo.try_attach(&["--annotation", &own_uid]);
    let text = output_text(&out);
    assert!(!out.status.success(), "no policy allows it: {text}");
    assert!(
        text.contains("capture.dev/proxy-uid") && text.contains("annotation policy"),
        "{text}"
    );
    let out = topo.try_attach(&[
        "--annotation-policy",
        policy_path,
        "--annotation",
        "traffic.sidecar.istio.io/excludeOutboundIPRanges=0.0.0.0/0",
    ]);
    let text = output_text(&out);
    assert!(
        !out.status.success(),
        "wider than the policy's bound: {text}"
    );
    assert!(
        text.contains("excludeOutboundIPRanges") && text.contains("\"openshift-uids\""),
        "{text}"
    );

    // By uid: the pod's own uid is exempt in any container, and 1337 is nobody's.
    topo.attach(&["--annotation-policy", policy_path, "--annotation", &own_uid]);
    let uids = &topo.status()["pods"][0]["config"]["proxy_uids"];
    assert_eq!(
        uids,
        &serde_json::json!([OPENSHIFT_UID]),
        "status shows the pod's uid"
    );
    let openshift = Who::new(OPENSHIFT_UID, OPENSHIFT_UID);
    run_cases_on(
        &topo,
        Some(Backend::Ebpf),
        &[
            Case::new("own uid", openshift.clone(), REMOTE, Expect::Remote(REMOTE))
                .in_cgroup(&app.path),
            Case::new("1337", Who::proxy(), REMOTE, Expect::Outbound(REMOTE))
                .in_cgroup(&proxy.path),
        ],
    );
    assert!(topo.detach().status.success());

    // By container: the pod's uid is exempt in the proxy container only.
    topo.attach(&[
        "--annotation-policy",
        policy_path,
        "--annotation",
        &own_uid,
        "--proxy-identity",
        "container",
        "--proxy-cgroup",
        proxy.path.to_str().unwrap(),
    ]);
    run_cases_on(
        &topo,
        Some(Backend::Ebpf),
        &[
            Case::new("proxy", openshift.clone(), REMOTE, Expect::Remote(REMOTE))
                .in_cgroup(&proxy.path),
            Case::new(
                "app as the proxy uid",
                openshift,
                REMOTE,
                Expect::Outbound(REMOTE),
            )
            .in_cgroup(&app.path),
        ],
    );
}
