//! Proxy identity by container: the owner exemption holds only in the proxy container's cgroup.
//! Each "container" is a cgroup below the pod's, as the runtime makes them; the proxy container's
//! is named with `attach --proxy-cgroup` or `capture proxy-container`, as the agent does from the
//! runtime.

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect},
    guards::TempFile,
    probe::Who,
    topology::Topology,
};

const REMOTE: &str = "10.0.0.5:80";

fn out_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

fn name_proxy(topo: &Topology, args: &[&str]) -> String {
    let netns = topo.pod.netns.path();
    let mut argv = vec!["proxy-container", "--netns", netns.to_str().unwrap()];
    argv.extend(args);
    let out = topo.capture(&argv);
    assert!(out.status.success(), "{argv:?}: {}", out_text(&out));
    out_text(&out)
}

/// The pod's proxy identity as `status --json` records it.
fn recorded_identity(topo: &Topology) -> serde_json::Value {
    topo.status()["pods"][0]["config"]["proxy_identity"].clone()
}

#[test]
fn only_the_proxy_container_escapes_capture() {
    let mut topo = Topology::new();
    let proxy = topo.pod.cgroup.child("istio-proxy");
    let app = topo.pod.cgroup.child("app");
    topo.start_all();

    // Istio's semantics by default: the proxy's uid goes direct from any container.
    topo.attach(&["--mode", "ebpf"]);
    run_cases_on(
        &topo,
        Some(Backend::Ebpf),
        &[
            Case::new("default uid", Who::proxy(), REMOTE, Expect::Remote(REMOTE))
                .in_cgroup(&app.path),
        ],
    );
    assert!(topo.detach().status.success());

    // By container, before the proxy container is known: the proxy's ids are refused where
    // they would leave the proxy, and decide as an app's would elsewhere; the app is captured.
    topo.attach(&["--mode", "ebpf", "--proxy-identity", "container"]);
    assert_eq!(recorded_identity(&topo)["proxy"]["state"], "unknown");
    run_cases_on(
        &topo,
        Some(Backend::Ebpf),
        &[
            Case::new(
                "unknown proxy",
                Who::proxy(),
                REMOTE,
                Expect::Refused("EPERM"),
            )
            .in_cgroup(&proxy.path),
            Case::new(
                "unknown, 1337 app",
                Who::proxy(),
                REMOTE,
                Expect::Refused("EPERM"),
            )
            .in_cgroup(&app.path),
            Case::new("unknown, app", Who::app(), REMOTE, Expect::Outbound(REMOTE))
                .in_cgroup(&app.path),
        ],
    );
    let errors = topo.status()["pods"][0]["counters"]["errors"]
        .as_u64()
        .expect("counters");
    assert!(errors >= 2, "refusals are counted: {errors}");

    let said = name_proxy(&topo, &["--cgroup", proxy.path.to_str().unwrap()]);
    assert!(said.contains("istio-proxy"), "{said}");
    let recorded = recorded_identity(&topo);
    assert_eq!(recorded["proxy"]["state"], "known", "{recorded}");
    let text = String::from_utf8_lossy(&topo.capture(&["status"]).stdout).to_string();
    assert!(
        text.contains("proxy identity container") && text.contains(proxy.path.to_str().unwrap()),
        "{text}"
    );
    let known = |proxy_path: &std::path::Path| {
        vec![
            Case::new("proxy", Who::proxy(), REMOTE, Expect::Remote(REMOTE)).in_cgroup(proxy_path),
            Case::new(
                "app as 1337",
                Who::proxy(),
                REMOTE,
                Expect::Outbound(REMOTE),
            )
            .in_cgroup(&app.path),
            Case::new(
                "app gid 1337",
                Who::new(1000, 1337),
                REMOTE,
                Expect::Outbound(REMOTE),
            )
            .in_cgroup(&app.path),
            Case::new(
                "app supplementary 1337",
                Who::app().with_groups(&[1337]),
                REMOTE,
                Expect::Outbound(REMOTE),
            )
            .in_cgroup(&app.path),
            Case::new(
                "pod cgroup as 1337",
                Who::proxy(),
                REMOTE,
                Expect::Outbound(REMOTE),
            ),
            Case::new(
                "proxy container as app",
                Who::app(),
                REMOTE,
                Expect::Outbound(REMOTE),
            )
            .in_cgroup(proxy_path),
        ]
    };
    run_cases_on(&topo, Some(Backend::Ebpf), &known(&proxy.path));

    // The runtime restarts the proxy: a new container, a new cgroup. The old one is nobody's.
    let restarted = topo.pod.cgroup.child("istio-proxy");
    name_proxy(&topo, &["--cgroup", restarted.path.to_str().unwrap()]);
    let mut cases = known(&restarted.path);
    cases.push(
        Case::new(
            "old proxy cgroup",
            Who::proxy(),
            REMOTE,
            Expect::Outbound(REMOTE),
        )
        .in_cgroup(&proxy.path),
    );
    run_cases_on(&topo, Some(Backend::Ebpf), &cases);

    // A pod without a proxy container: nothing is exempt by owner.
    name_proxy(&topo, &["--none"]);
    run_cases_on(
        &topo,
        Some(Backend::Ebpf),
        &[
            Case::new("no proxy", Who::proxy(), REMOTE, Expect::Outbound(REMOTE))
                .in_cgroup(&restarted.path),
        ],
    );
}

#[test]
fn proxy_identity_bad_input_is_refused_and_named() {
    let topo = Topology::new();
    let proxy = topo.pod.cgroup.child("istio-proxy");
    let elsewhere = capture_tests::guards::CgroupGuard::new("capture-not-the-pod");
    let refused = |extra: &[&str], says: &[&str]| {
        let out = topo.try_attach(extra);
        let text = out_text(&out);
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
    assert_eq!(recorded_identity(&topo)["proxy"]["state"], "known");
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
    let text = out_text(&out);
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
    let text = out_text(&out);
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
