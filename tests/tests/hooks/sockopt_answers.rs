//! A captured pod's getsockopt calls get the kernel's own answers: every option of the survey
//! (`capture_tests::sockopt_survey`), at every level, answers the same inside the pod's cgroup as
//! outside it, including one answer longer than a page, which a cgroup getsockopt program that
//! leaves optlen alone turns into EFAULT on kernels before 6.5.

use capture_tests::{probe::probe_in, sockopt_survey::PEER_GROUPS, topology::Topology};
use serde_json::Value;

fn survey(topo: &Topology, in_pod_cgroup: bool) -> Value {
    let cgroup = in_pod_cgroup.then_some(topo.pod.cgroup.path.as_path());
    let out = probe_in(&topo.pod.netns.path(), cgroup, None)
        .arg("sockopts")
        .output()
        .expect("the probe");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).expect("the survey's JSON")
}

#[test]
fn every_option_answers_as_it_does_uncaptured() {
    let topo = Topology::new();
    topo.attach(&[]);
    let uncaptured = survey(&topo, false);
    let captured = survey(&topo, true);
    let groups = &uncaptured["SO_PEERGROUPS"];
    assert_eq!(groups["ok"], true, "{groups}");
    assert_eq!(
        groups["len"],
        PEER_GROUPS * 4,
        "the survey's large answer is larger than a page"
    );
    let (Value::Object(want), Value::Object(got)) = (&uncaptured, &captured) else {
        panic!("surveys are objects");
    };
    let differing: Vec<String> = want
        .iter()
        .filter(|(name, answer)| got.get(*name) != Some(answer))
        .map(|(name, answer)| format!("{name}: uncaptured {answer}, captured {:?}", got.get(name)))
        .collect();
    assert!(differing.is_empty(), "{}", differing.join("\n"));
    assert_eq!(want.len(), got.len());
}
