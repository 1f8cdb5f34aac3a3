//! Bad input: one clear error line naming the input and the fix, a non-zero exit, and nothing
//! attached afterwards.

use capture_tests::topology::{cgroup_programs, Topology};

/// Runs a failing `capture attach` and returns its one error line.
fn attach_error(topo: &Topology, args: &[&str]) -> String {
    let out = topo.capture(args);
    let err = String::from_utf8_lossy(&out.stderr).trim().to_string();
    assert!(!out.status.success(), "{args:?} should fail");
    assert_eq!(err.lines().count(), 1, "one error line, got: {err}");
    assert!(err.starts_with("capture: error: "), "{err}");
    assert!(
        cgroup_programs(&topo.pod.cgroup.path).is_empty(),
        "{args:?} left programs attached"
    );
    assert_eq!(
        topo.status()["pods"].as_array().map_or(0, Vec::len),
        0,
        "{args:?} left a pod record"
    );
    err
}

fn attach_args<'a>(netns: &'a str, cgroup: &'a str, extra: &[&'a str]) -> Vec<&'a str> {
    let mut v = vec![
        "attach",
        "--netns",
        netns,
        "--cgroup",
        cgroup,
        "--pod-ip",
        "10.1.0.10",
    ];
    v.extend(extra);
    v
}

#[test]
fn bad_paths_are_named() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path().to_str().unwrap().to_string();
    let cgroup = topo.pod.cgroup.path.to_str().unwrap().to_string();
    let missing_cg = format!("{cgroup}-missing");

    let err = attach_error(&topo, &attach_args(&netns, &missing_cg, &[]));
    assert!(
        err.contains(&missing_cg) && err.contains("cgroup v2 directory"),
        "{err}"
    );

    let err = attach_error(&topo, &attach_args(&netns, "/tmp", &[]));
    assert!(err.contains("/tmp is not a cgroup v2 directory"), "{err}");

    let err = attach_error(&topo, &attach_args("/etc/hostname", &cgroup, &[]));
    assert!(
        err.contains("/etc/hostname is not a network namespace"),
        "{err}"
    );

    let err = attach_error(&topo, &attach_args("/proc/self/ns/mnt", &cgroup, &[]));
    assert!(err.contains("is not a network namespace"), "{err}");

    let err = attach_error(
        &topo,
        &attach_args("/var/run/netns/no-such-pod", &cgroup, &[]),
    );
    assert!(
        err.contains("/var/run/netns/no-such-pod") && err.contains("netns"),
        "{err}"
    );
}

#[test]
fn bad_annotations_and_ids_are_named() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path().to_str().unwrap().to_string();
    let cgroup = topo.pod.cgroup.path.to_str().unwrap().to_string();
    let cases: &[(&[&str], &[&str])] = &[
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/33",
            ],
            &["includeOutboundIPRanges", "10.0.0.0/33"],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/excludeOutboundIPRanges=10.0.0.1",
            ],
            &["excludeOutboundIPRanges", "/32"],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/excludeOutboundIPRanges=*",
            ],
            &[
                "excludeOutboundIPRanges",
                "only as the whole value of an include list",
            ],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/excludeOutboundPorts=80,http",
            ],
            &["excludeOutboundPorts", "\"http\" is not a port"],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/includeOutboundPorts=0",
            ],
            &["includeOutboundPorts", "1-65535"],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/excludeInboundPorts=70000",
            ],
            &["excludeInboundPorts", "70000"],
        ),
        (
            &["--annotation", "sidecar.istio.io/interceptionMode=NONE"],
            &["interceptionMode", "REDIRECT or TPROXY"],
        ),
        (
            &["--annotation", "status.sidecar.istio.io/port=x"],
            &["status.sidecar.istio.io/port"],
        ),
        (&["--proxy-uid", "1,2,3,4,5"], &["at most 4"]),
        // Rejected by Istio's injector too: empty list items, spaces around CIDRs.
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/excludeOutboundPorts=80,,443",
            ],
            &["excludeOutboundPorts", "empty item"],
        ),
        (
            &[
                "--annotation",
                "traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/8, 10.2.0.0/16",
            ],
            &["includeOutboundIPRanges", "spaces"],
        ),
    ];
    for (extra, needles) in cases {
        let err = attach_error(&topo, &attach_args(&netns, &cgroup, extra));
        for n in *needles {
            assert!(
                err.contains(n),
                "{extra:?}: error {err:?} does not mention {n:?}"
            );
        }
    }
}

#[test]
fn malformed_arguments_fail_before_anything_happens() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path().to_str().unwrap().to_string();
    let cgroup = topo.pod.cgroup.path.to_str().unwrap().to_string();
    for extra in [
        &["--proxy-uid", "istio"][..],
        &["--annotation", "no-equals-sign"],
        &["--pod-ip", "10.1.0"],
    ] {
        let out = topo.capture(&attach_args(&netns, &cgroup, extra));
        assert!(!out.status.success(), "{extra:?}");
        assert!(cgroup_programs(&topo.pod.cgroup.path).is_empty());
    }
}

#[test]
fn detach_of_a_pod_that_is_not_captured_is_an_error() {
    let topo = Topology::new();
    let out = topo.detach();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is not captured"), "{err}");
}

#[test]
fn status_of_an_empty_node() {
    let topo = Topology::new();
    let status = topo.status();
    assert_eq!(status["pods"].as_array().unwrap().len(), 0);
    assert_eq!(status["programs_loaded"], false);
}
