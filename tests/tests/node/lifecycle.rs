//! Attach/detach lifecycle on real traffic: detach restores direct traffic and leaves nothing,
//! late joiners are captured, pods never see each other's state, failures roll back.

use std::time::Duration;

use capture_tests::{
    cases::{run_cases, Case, Expect::*},
    guards::ReadOnlyBind,
    probe::{ConnectOpts, Outcome, Who},
    topology::{
        cgroup_programs, fill_cidr_lists, only_pod_links, pinned_map_len, pod_pins_left, Topology,
        POD_CGROUP_HOOKS,
    },
};

#[test]
fn detach_restores_direct_traffic_and_leaves_nothing() {
    let mut topo = Topology::new();
    topo.attach(&[]);
    topo.start_all();
    assert_eq!(
        cgroup_programs(&topo.pod.cgroup.path).len(),
        POD_CGROUP_HOOKS,
        "all eight cgroup hooks attached"
    );
    run_cases(
        &topo,
        &[Case::new(
            "attached",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );

    let out = topo.detach();
    assert!(
        out.status.success(),
        "detach: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    run_cases(
        &topo,
        &[
            Case::new(
                "detached v4",
                Who::app(),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
            Case::new(
                "detached v6",
                Who::app(),
                "[fd00:2::5]:80",
                Remote("[fd00:2::5]:80"),
            ),
        ],
    );
    assert!(
        cgroup_programs(&topo.pod.cgroup.path).is_empty(),
        "no program left on the cgroup"
    );
    for map in [
        "POD_CONFIGS",
        "POD_COUNTERS",
        "PORT_LISTS",
        "CIDR_LISTS",
        "HANDOFF",
        "LOOPBACK_DESTS",
    ] {
        assert_eq!(
            pinned_map_len(&topo.dirs.bpffs, map),
            0,
            "{map} still has entries"
        );
    }
    assert!(!pod_pins_left(&topo.dirs.bpffs), "pod link pins left");
    assert_eq!(topo.status()["pods"].as_array().unwrap().len(), 0);

    // Capture can come back on the same pod.
    topo.attach(&[]);
    run_cases(
        &topo,
        &[Case::new(
            "re-attached",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );
}

#[test]
fn a_detach_that_cannot_remove_the_pods_pins_keeps_its_config_and_record() {
    let mut topo = Topology::new();
    topo.attach(&[]);
    topo.start_all();
    let links = only_pod_links(&topo.dirs.bpffs);
    let read_only = ReadOnlyBind::new(&links);

    let out = topo.detach();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "detach succeeded with its pins still there"
    );
    assert!(
        err.contains(&links.display().to_string()) && err.contains("tried again"),
        "{err}"
    );
    // The config stays with the links, so no connect in the pod meets programs without it.
    assert_eq!(pinned_map_len(&topo.dirs.bpffs, "POD_CONFIGS"), 1);
    let got = topo.tcp(&Who::app(), "10.0.0.5:80");
    assert!(got.ok(), "a connect after the failed release: {:?}", got.0);
    let status = topo.status();
    let pod = &status["pods"][0];
    assert_eq!(pod["in_force"], false, "{pod}");
    assert!(
        pod["release_failed"]
            .as_str()
            .is_some_and(|w| w.contains("stay")),
        "{pod}"
    );

    drop(read_only);
    let out = topo.detach();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(pinned_map_len(&topo.dirs.bpffs, "POD_CONFIGS"), 0);
    assert!(!pod_pins_left(&topo.dirs.bpffs), "pod link pins left");
    assert_eq!(topo.status()["pods"].as_array().unwrap().len(), 0);
}

#[test]
fn a_process_that_joins_the_cgroup_after_attach_is_captured() {
    let mut topo = Topology::new();
    // Started in the pod netns but outside its cgroup, before capture exists.
    let client = topo.spawn_waiting_client(&Who::app(), "10.0.0.5:80");
    topo.attach(&[]);
    topo.start_all();
    topo.pod.cgroup.add(client.pid());
    let got = Outcome::parse(&client.release_and_wait("go\n"));
    got.assert_served_by("outbound", "");
    assert_eq!(got.orig().as_deref(), Some("10.0.0.5:80"));
}

/// Capture attached under a running proxy: its listeners were opened before any capture
/// program saw them; attach finds and registers them (on every kernel, also those whose `sock_ops`
/// cannot ask which netns a socket is in).
#[test]
fn a_proxy_started_before_attach_still_learns_the_original_destination() {
    let mut topo = Topology::new();
    topo.start_all();
    topo.attach(&[]);
    run_cases(
        &topo,
        &[Case::new(
            "proxy older than capture",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );
}

#[test]
fn status_counts_decisions() {
    let mut topo = Topology::new();
    topo.attach(&[]);
    topo.start_all();
    run_cases(
        &topo,
        &[
            Case::new(
                "redirect",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "redirect again",
                Who::app(),
                "[fd00:2::5]:80",
                Outbound("[fd00:2::5]:80"),
            ),
            Case::new("owner", Who::proxy(), "10.0.0.5:80", Remote("10.0.0.5:80")),
            Case::new("local", Who::app(), "127.0.0.1:9090", App),
        ],
    );
    let status = topo.status();
    let pod = &status["pods"][0];
    assert_eq!(pod["in_force"], true, "{pod}");
    let c = &pod["counters"];
    assert_eq!(c["redirected_outbound"], 2, "{c}");
    // The proxy's own listeners and connections count as owner passes too.
    assert!(c["passed_owner"].as_u64().unwrap() >= 1, "{c}");
    assert!(c["passed_local"].as_u64().unwrap() >= 1, "{c}");
    assert_eq!(c["errors"], 0, "{c}");
    assert_eq!(
        status["pending_handoffs"], 0,
        "hand-off entries must leave with the handshake"
    );
}

#[test]
fn attach_is_idempotent_and_refuses_a_conflicting_second_attach() {
    let topo = Topology::new();
    topo.attach(&[]);
    topo.attach(&[]);
    let out = topo.try_attach(&[
        "--annotation",
        "traffic.sidecar.istio.io/excludeOutboundPorts=80",
    ]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already captured") && err.contains("capture detach"),
        "{err}"
    );
    assert_eq!(
        cgroup_programs(&topo.pod.cgroup.path).len(),
        POD_CGROUP_HOOKS,
        "exactly one set of hooks"
    );
}

/// Two pods on one node whose proxies see the very same loopback 4-tuple
/// (127.0.0.1:P -> 127.0.0.1:15006) at the same time, for different original destinations.
#[test]
fn pods_with_colliding_loopback_tuples_keep_their_own_destinations() {
    let mut a = Topology::new();
    // Same node: b uses a's pin and state directories (and so a's programs and maps).
    let mut b = Topology::with_dirs(a.dirs.shared());
    a.attach(&[]);
    b.attach(&[]);
    for t in [&mut a, &mut b] {
        t.start_proxy();
        t.start_app();
    }
    let rounds = 12;
    let run = |topo: &Topology, to: &'static str| {
        (0..rounds)
            .map(|i| {
                let opts = ConnectOpts {
                    bind: Some(format!("127.0.0.1:{}", 41000 + i)),
                    ..ConnectOpts::default()
                };
                let got = topo.connect(&Who::proxy(), to, &opts);
                (got.server(), got.orig(), got.peer_seen())
            })
            .collect::<Vec<_>>()
    };
    let (got_a, got_b) = std::thread::scope(|s| {
        let ha = s.spawn(|| run(&a, "127.0.0.2:8080"));
        let hb = s.spawn(|| run(&b, "127.0.0.3:9090"));
        (ha.join().unwrap(), hb.join().unwrap())
    });
    for (i, (ga, gb)) in got_a.iter().zip(&got_b).enumerate() {
        let port = 41000 + i;
        assert_eq!(
            ga,
            &(
                Some("inbound".into()),
                Some("127.0.0.2:8080".into()),
                Some(format!("127.0.0.1:{port}"))
            ),
            "pod a round {i}"
        );
        assert_eq!(
            gb,
            &(
                Some("inbound".into()),
                Some("127.0.0.3:9090".into()),
                Some(format!("127.0.0.1:{port}"))
            ),
            "pod b round {i}"
        );
    }
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(
        pinned_map_len(&a.dirs.bpffs, "HANDOFF"),
        0,
        "hand-off entries left behind"
    );
}

/// Whether the pod's lo carries `::6/128` (Istio's IPv6 inbound-passthrough source).
fn has_passthrough_v6(topo: &Topology) -> bool {
    let out = std::process::Command::new("ip")
        .args([
            "-n",
            &topo.pod.netns.name,
            "-6",
            "addr",
            "show",
            "dev",
            "lo",
        ])
        .output()
        .expect("ip");
    String::from_utf8_lossy(&out.stdout).contains("::6/128")
}

#[test]
fn a_failed_attach_rolls_back_and_leaves_other_pods_alone() {
    // Fill the node's CIDR map almost completely (as many pods at their quotas would), then let
    // pod b overflow it.
    let cidrs = |base: u32, n: u32| -> String {
        (0..n)
            .map(|i| {
                let v = base + i;
                format!("{}.{}.{}.0/24", 11 + (v >> 16), (v >> 8) & 0xff, v & 0xff)
            })
            .collect::<Vec<_>>()
            .join(",")
    };
    let mut a = Topology::new();
    let include = "traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/16";
    // Sized for 64 pods, the map holds 64 pods' 256 CIDRs: 16,384.
    a.attach(&["--annotation", include, "--max-pods", "64"]);
    a.start_all();
    fill_cidr_lists(&a.dirs.bpffs, 16300);

    let b = Topology::with_dirs(a.dirs.shared());
    let exclude_b = format!(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges={}",
        cidrs(20000, 200)
    );
    let out = b.try_attach(&["--annotation", &exclude_b]);
    assert!(
        !out.status.success(),
        "attach b should overflow the CIDR map"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.trim().lines().count(), 1, "one error line: {err}");
    assert!(err.contains("CIDR") && err.contains("full"), "{err}");

    assert!(
        cgroup_programs(&b.pod.cgroup.path).is_empty(),
        "b half-attached"
    );
    // The IPv6 inbound-passthrough address the attach put on b's lo goes with the rest; a keeps
    // its own.
    assert!(!has_passthrough_v6(&b), "b keeps ::6 after a failed attach");
    assert!(has_passthrough_v6(&a), "a lost ::6");
    assert_eq!(
        b.status()["pods"].as_array().unwrap().len(),
        1,
        "only a is recorded"
    );
    assert_eq!(pinned_map_len(&a.dirs.bpffs, "POD_CONFIGS"), 1);
    assert_eq!(
        pinned_map_len(&a.dirs.bpffs, "CIDR_LISTS"),
        16301,
        "b's partial entries were removed"
    );
    run_cases(
        &a,
        &[Case::new(
            "a still captured",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );
}

#[test]
fn other_getsockopt_calls_keep_the_kernels_answer() {
    let mut topo = Topology::new();
    topo.attach(&[]);
    topo.start_all();
    // Captured: the proxy's socket answers SO_ORIGINAL_DST, and IP_TTL (same level) is untouched.
    for to in ["10.0.0.5:80", "[fd00:2::5]:80"] {
        let got = topo.tcp(&Who::app(), to);
        got.assert_served_by("outbound", "");
        assert_eq!(got.server_ttl(), Some(64), "{:?}", got.0);
    }
    // Not captured (app to its own IP): the app's listener gets the kernel's own SO_ORIGINAL_DST
    // error, the same as an uncaptured listener in the remote netns.
    let inside = topo.tcp(&Who::app(), "10.1.0.10:8080");
    let outside = topo.tcp(&Who::proxy(), "10.0.0.5:80");
    assert_eq!(inside.server().as_deref(), Some("app"));
    assert_eq!(outside.server().as_deref(), Some("remote"));
    assert!(inside.orig_error().is_some(), "{:?}", inside.0);
    assert_eq!(inside.orig_error(), outside.orig_error());
    assert_eq!(inside.server_ttl(), Some(64));
}
