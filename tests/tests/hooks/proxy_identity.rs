//! Proxy identity by container: the owner exemption holds only in the proxy container's cgroup.
//! Each "container" is a cgroup below the pod's, as the runtime makes them; the proxy container's
//! is named with `attach --proxy-cgroup` or `capture proxy-container`, as the agent does from the
//! runtime.

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect},
    guards::output_text,
    probe::Who,
    topology::Topology,
};

const REMOTE: &str = "10.0.0.5:80";

fn name_proxy(topo: &Topology, args: &[&str]) -> String {
    let netns = topo.pod.netns.path();
    let mut argv = vec!["proxy-container", "--netns", netns.to_str().unwrap()];
    argv.extend(args);
    let out = topo.capture(&argv);
    assert!(out.status.success(), "{argv:?}: {}", output_text(&out));
    output_text(&out)
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, its steps in the order they happen"
)]
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
    assert_eq!(topo.proxy_identity()["proxy"]["state"], "unknown");
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
    let recorded = topo.proxy_identity();
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
