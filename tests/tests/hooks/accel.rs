//! The app-to-proxy acceleration: its correctness checks run on this kernel, the node follows
//! their verdict, and an accelerated pod's traffic (and every answer the proxy relies on) stays
//! as it is without acceleration.

use capture_tests::accel::{differences, EDGE_CASES};
use capture_tests::cni::{CgroupDriver, Node, Pod, MESHED};
use capture_tests::kernel::{record_skip, Feature};
use capture_tests::probe::{connect_with, Outcome};
use serde_json::Value;
use std::io::Write as _;

const ASK: (&str, &str) = ("capture.dev/accelerate", "true");

/// Where the app's connections go: the node's listener, at the pods' gateway.
const GATEWAY_80: &str = "10.88.0.1:80";

fn meshed_asking() -> Vec<(&'static str, &'static str)> {
    vec![MESHED[0], ASK]
}

/// `capture accel-check --json`, with its report.
fn check(node: &Node, extra: &[&str]) -> (bool, Value) {
    let mut args = vec!["accel-check", "--json"];
    args.extend_from_slice(extra);
    let out = node.capture(&args);
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("accel-check report ({e}): {out:?}"));
    (out.status.success(), report)
}

fn pod_status<'a>(status: &'a Value, pod: &Pod) -> &'a Value {
    status["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .find(|p| p["pod"]["name"] == pod.name.as_str())
        .unwrap_or_else(|| panic!("{} in status: {status}", pod.name))
}

fn sk_msg_refused(status: &Value) -> Option<String> {
    let node = std::fs::read_to_string(
        std::path::Path::new(&status["state_dir"].as_str().expect("state dir")).join("node.json"),
    )
    .ok()?;
    let node: Value = serde_json::from_str(&node).ok()?;
    node["unavailable"]
        .as_array()?
        .iter()
        .find(|u| u["hook"] == "sk_msg")
        .map(|u| u["reason"].to_string())
}

fn captured_answers(got: &Outcome) -> (Option<String>, Option<String>, Option<String>) {
    (got.server(), got.orig(), got.client_peer())
}

#[test]
fn every_case_runs_and_the_node_follows_the_verdict() {
    let node = Node::new();
    let (clean, report) = check(&node, &[]);
    let cases = report["cases"].as_array().expect("cases");
    assert!(cases.len() >= 20, "{report}");
    for case in cases {
        // Without acceleration every case must run: an error there is a broken case, which
        // would make every kernel look different.
        assert!(
            case["plain"]["Ok"].is_array(),
            "case {} failed plain: {case}",
            case["name"]
        );
    }
    let failed = differences(&report);
    // Straight to the process's stderr, past the test harness's capture: the kernel matrix's
    // logs keep each kernel's verdict.
    let _ = writeln!(
        std::io::stderr(),
        "capture-accel-verdict: {} bytes accelerated, differences: {failed:?}",
        report["accelerated_bytes"]
    );
    assert_eq!(
        clean,
        failed.is_empty() && report["accelerated_bytes"].as_u64() > Some(0)
    );

    let _remote = node.start_remote();
    let _agent = node.start_agent_with("ebpf", &["--accelerate"]);
    let doctor = node.capture(&["doctor", "--json"]);
    let doctor: Value = serde_json::from_slice(&doctor.stdout).expect("doctor JSON");
    assert_eq!(doctor["acceleration"]["allowed"], true, "{doctor}");
    assert_eq!(
        doctor["acceleration"]["accelerating"],
        Value::Bool(clean),
        "{doctor}"
    );
    assert_eq!(
        doctor["acceleration"]["check"]["failed"]
            .as_array()
            .map(Vec::len),
        Some(failed.len()),
        "{doctor}"
    );
    let mut pod = node.pod("asks", CgroupDriver::Cgroupfs, &meshed_asking());
    node.add(&mut pod).expect("ADD");
    let status = node.status();
    let accel = &pod_status(&status, &pod)["acceleration"];
    assert_eq!(accel["active"], Value::Bool(clean), "{accel}");
    if !clean {
        let reason = accel["reason"].as_str().expect("a reason");
        match sk_msg_refused(&status) {
            Some(why) => assert!(reason.contains("refused"), "{reason} ({why})"),
            None => {
                for name in &failed {
                    assert!(
                        reason.contains(name.as_str()),
                        "{reason} should name {name}"
                    );
                }
            }
        }
    }
    node.del(&pod).expect("DEL");
}

#[test]
fn accelerated_pods_answer_as_unaccelerated_ones_and_count_their_bytes() {
    let node = Node::new();
    let (_, report) = check(&node, &[]);
    if report["accelerated_bytes"].as_u64() == Some(0) {
        let refused = sk_msg_refused(&node.status());
        assert!(
            refused.is_some(),
            "no byte accelerated, yet sk_msg loaded: {report}"
        );
        record_skip(
            Feature::SkMsgAcceleration,
            &format!("the kernel refused the sk_msg program: {refused:?}"),
        );
        return;
    }
    // Accept the edge cases some kernels differ in, so that the pod is accelerated here; a kernel
    // that differs in anything else is not accelerated even so, and says why.
    let differences = differences(&report);
    let unacceptable: Vec<&String> = differences
        .iter()
        .filter(|d| !EDGE_CASES.contains(&d.as_str()))
        .collect();
    let accepting = EDGE_CASES.join(",");
    let _remote = node.start_remote();
    let agent = node.start_agent_with(
        "ebpf",
        &["--accelerate", "--accelerate-accepting", &accepting],
    );
    if !unacceptable.is_empty() {
        let mut pod = node.pod("asks", CgroupDriver::Cgroupfs, &meshed_asking());
        node.add(&mut pod).expect("ADD");
        let status = node.status();
        let accel = &pod_status(&status, &pod)["acceleration"];
        assert_eq!(accel["active"], false, "{accel}");
        let reason = accel["reason"].as_str().expect("a reason");
        for name in unacceptable {
            assert!(
                reason.contains(name.as_str()),
                "{reason} should name {name}"
            );
        }
        node.del(&pod).expect("DEL");
        return;
    }
    let mut fast = node.pod("fast", CgroupDriver::Cgroupfs, &meshed_asking());
    let mut plain = node.pod("plain", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut fast).expect("ADD");
    node.add(&mut plain).expect("ADD");
    let _fast_servers = fast.start_servers();
    let _plain_servers = plain.start_servers();

    let before = node.status();
    let fast_status = pod_status(&before, &fast);
    assert_eq!(fast_status["acceleration"]["active"], true, "{fast_status}");
    assert!(
        pod_status(&before, &plain).get("acceleration").is_none(),
        "a pod that did not ask has no acceleration"
    );

    for _ in 0..5 {
        let a = connect_with(fast.app_client(), GATEWAY_80);
        let b = connect_with(plain.app_client(), GATEWAY_80);
        assert_eq!(a.server().as_deref(), Some("outbound"), "{:?}", a.0);
        assert_eq!(
            captured_answers(&a),
            captured_answers(&b),
            "{:?} vs {:?}",
            a.0,
            b.0
        );
    }
    let after = node.status();
    let counters = &pod_status(&after, &fast)["acceleration"]["counters"];
    assert!(
        counters["accelerated_bytes"].as_u64() > Some(0),
        "the proxy's answers went through the sk_msg program: {counters}"
    );
    assert!(
        counters["accelerated_sends"].as_u64() >= Some(5),
        "{counters}"
    );
    let metrics = agent.checked_metrics();
    for series in [
        "capture_pod_accelerated{",
        "capture_pod_accelerated_bytes_total{",
        "capture_pod_accelerated_socket_directions_total{",
    ] {
        assert!(
            metrics
                .lines()
                .any(|l| l.starts_with(series) && l.contains("pod=\"fast\"")),
            "{series} for the accelerated pod in:\n{metrics}"
        );
    }
    node.del(&fast).expect("DEL");
    node.del(&plain).expect("DEL");
}

#[test]
fn the_iptables_backend_says_it_has_no_acceleration() {
    let node = Node::new();
    let _agent = node.start_agent_with("iptables", &[]);
    let mut pod = node.pod("asks", CgroupDriver::Cgroupfs, &meshed_asking());
    node.add(&mut pod).expect("ADD");
    let status = node.status();
    let accel = &pod_status(&status, &pod)["acceleration"];
    assert_eq!(accel["active"], false);
    assert!(
        accel["reason"]
            .as_str()
            .is_some_and(|r| r.contains("iptables")),
        "{accel}"
    );
    node.del(&pod).expect("DEL");
}

#[test]
fn a_bad_annotation_value_fails_the_add_and_names_it() {
    let node = Node::new();
    let _agent = node.start_agent_with("ebpf", &["--accelerate"]);
    let mut pod = node.pod(
        "bad",
        CgroupDriver::Cgroupfs,
        &[MESHED[0], ("capture.dev/accelerate", "yes")],
    );
    let err = node.add(&mut pod).expect_err("a bad value");
    let msg = err.to_string();
    assert!(
        msg.contains("capture.dev/accelerate") && msg.contains("yes"),
        "{msg}"
    );
}

#[test]
fn an_agent_killed_during_the_checks_leaves_nothing_behind() {
    let node = Node::new();
    let mut agent = node.start_agent_with("ebpf", &["--accelerate"]);
    let pid = agent.pid();
    // The checks run in the background from the agent's start; kill it in the middle of them.
    capture_tests::wait::wait_for(
        std::time::Duration::from_mins(1),
        "the checks to start",
        || node.dirs.state.join("accel-check.json").exists(),
    );
    std::thread::sleep(std::time::Duration::from_millis(300));
    agent.kill_hard();
    let scratch_of_dead_agent = || {
        let root = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
        std::fs::read_dir(root)
            .expect("cgroup root")
            .flatten()
            .any(|e| {
                e.file_name()
                    .to_str()
                    .is_some_and(|n| n.starts_with(&format!("capture-accel-check-{pid}-")))
            })
    };
    // The next agent removes the dead one's scratch cgroup and releases its scratch pod.
    let _agent = node.start_agent("ebpf");
    capture_tests::wait::wait_until(
        std::time::Duration::from_secs(30),
        "the killed agent's scratch pod to go",
        || {
            let (cgroup, links) = (
                scratch_of_dead_agent(),
                capture_tests::topology::pod_pins_left(&node.dirs.bpffs),
            );
            if cgroup || links {
                Err(format!("cgroup: {cgroup}, links: {links}"))
            } else {
                Ok(())
            }
        },
    );
}

#[test]
fn a_pod_captured_before_the_node_allowed_acceleration_stays_as_it_was_and_says_why() {
    let topo = capture_tests::topology::Topology::new();
    let ask = [
        "--mode",
        "ebpf",
        "--annotation",
        "capture.dev/accelerate=true",
    ];
    topo.attach(&ask);
    let before = topo.status();
    assert_eq!(
        before["pods"][0]["acceleration"]["active"], false,
        "{before}"
    );
    let allowed = capture_tests::accel::allow(&topo);
    // The same request again is the same pod: no error, and no change.
    topo.attach(&ask);
    let after = topo.status();
    let accel = &after["pods"][0]["acceleration"];
    assert_eq!(accel["active"], false, "{after}");
    if allowed {
        assert!(
            accel["reason"]
                .as_str()
                .is_some_and(|r| r.contains("after the pod was captured")),
            "{accel}"
        );
    }
}
