//! `capture validate` inside the pod (parity-spec.md section G): passes as the proxy when either backend is
//! in force, fails with exit code 126 and a reason otherwise.

use std::time::{Duration, Instant};

use capture_tests::{
    cases::Backend,
    probe::Who,
    topology::{capture_bin, Topology},
};

fn validate(topo: &Topology, who: &Who, timeout: &str) -> (Option<i32>, String, String, Duration) {
    let bin = capture_bin();
    let start = Instant::now();
    let out = topo.run_in_pod(
        who,
        &[bin.to_str().unwrap(), "validate", "--timeout", timeout],
    );
    (
        out.status.code(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        start.elapsed(),
    )
}

#[test]
fn passes_as_the_proxy_under_both_backends() {
    for backend in Backend::EVERY {
        let topo = Topology::new();
        topo.attach(&["--mode", backend.mode()]);
        let (code, stdout, stderr, _) = validate(&topo, &Who::proxy(), "5s");
        assert_eq!(code, Some(0), "{backend:?}: {stdout} {stderr}");
        assert!(
            stdout.contains("capture is in force") && stdout.contains("127.0.0.6:15002"),
            "{stdout}"
        );
    }
}

#[test]
fn fails_within_its_timeout_when_nothing_is_attached() {
    let topo = Topology::new();
    let (code, _, stderr, took) = validate(&topo, &Who::proxy(), "2s");
    assert_eq!(code, Some(126), "{stderr}");
    assert!(stderr.contains("not in force"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    assert!(took < Duration::from_secs(6), "took {took:?}");
}

#[test]
fn fails_for_a_non_proxy_uid() {
    // T28: the probe from uid 1000 to 127.0.0.6 stays on loopback and is refused.
    for backend in Backend::EVERY {
        let topo = Topology::new();
        topo.attach(&["--mode", backend.mode()]);
        let (code, _, stderr, _) = validate(&topo, &Who::app(), "2s");
        assert_eq!(code, Some(126), "{backend:?}: {stderr}");
    }
}
