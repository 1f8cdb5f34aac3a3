//! A node booted without cgroup v2: its pods' cgroups are in a v1 hierarchy (one of the test's own,
//! mounted for it). The rule backends need only the pod's netns and capture such a pod; the ebpf
//! backend attaches to cgroup v2 only and refuses it, saying why; `auto` falls back per pod, through
//! the CNI plugin too, which finds the pod's cgroup in the v1 hierarchy by itself.

use std::path::{Path, PathBuf};

use capture_tests::{
    cni::{CgroupDriver, Node, MESHED},
    guards::{output_text, run, CgroupV1Mount},
    kernel::{record_skip, Feature},
    probe::Who,
    topology::{Topology, POD_IP4, POD_IP6},
};

fn attach_v1(topo: &Topology, cgroup: &Path, extra: &[&str]) -> std::process::Output {
    topo.try_attach_in(cgroup, &[POD_IP4, POD_IP6], extra)
}

fn v1_hierarchy() -> Option<CgroupV1Mount> {
    let mount = CgroupV1Mount::new();
    if mount.is_none() {
        record_skip(
            Feature::CgroupV1Hierarchy,
            "this kernel does not mount a named cgroup v1 hierarchy",
        );
    }
    mount
}

fn pod_cgroup(v1: &CgroupV1Mount, name: &str) -> PathBuf {
    let path = v1.path.join(name);
    std::fs::create_dir(&path).expect("a v1 cgroup");
    path
}

#[test]
fn rule_backends_capture_a_cgroup_v1_pod_and_ebpf_refuses_it() {
    let Some(v1) = v1_hierarchy() else {
        return;
    };
    let refused = Topology::new();
    let cgroup = pod_cgroup(&v1, "refused");
    let out = attach_v1(&refused, &cgroup, &["--mode", "ebpf"]);
    let err = output_text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("cgroup v1")
            && err.contains(cgroup.to_str().unwrap())
            && err.contains("systemd.unified_cgroup_hierarchy=1")
            && err.contains("--mode nftables"),
        "{err}"
    );
    assert_eq!(refused.status()["pods"].as_array().map_or(0, Vec::len), 0);

    for (i, (args, backend)) in [
        (&["--mode", "iptables"][..], "iptables"),
        (&["--mode", "nftables"][..], "nftables"),
        (
            &["--mode", "auto", "--fallback", "iptables"][..],
            "iptables",
        ),
        (
            &["--mode", "auto", "--fallback", "nftables"][..],
            "nftables",
        ),
    ]
    .into_iter()
    .enumerate()
    {
        let mut topo = Topology::new();
        let cgroup = pod_cgroup(&v1, &format!("pod{i}"));
        let out = attach_v1(&topo, &cgroup, args);
        assert!(out.status.success(), "{args:?}: {}", output_text(&out));
        topo.start_all();
        topo.tcp(&Who::app(), "10.0.0.5:80")
            .assert_served_by("outbound", backend);
        topo.connect_from_remote(&format!("{POD_IP4}:8080"))
            .assert_served_by("inbound", backend);
        let status = topo.status();
        let pod = &status["pods"][0];
        assert_eq!(pod["mode"], backend, "{args:?}: {pod}");
        assert_eq!(pod["in_force"], true, "{args:?}: {pod}");
        if args[1] == "auto" {
            let why = pod["fallback_reason"].as_str().unwrap_or_default();
            assert!(why.contains("cgroup v1"), "{pod}");
        }
        assert!(topo.detach().status.success());
    }
    drop(refused);
    // The test's hierarchy goes with its guard: a named hierarchy left in the kernel would be in
    // every process's /proc/PID/cgroup for the host's life.
    let member = format!(":name={}:", v1.name());
    drop(v1);
    let cgroups = std::fs::read_to_string("/proc/self/cgroup").expect("/proc/self/cgroup");
    assert!(!cgroups.contains(&member), "{member} remains: {cgroups}");
}

#[test]
fn a_cni_add_on_a_cgroup_v1_node_succeeds_through_the_fallback() {
    let Some(v1) = v1_hierarchy() else {
        return;
    };
    let node = Node::under(&v1.path);
    // capture-cni finds the pod's cgroup by itself, as on a node: no cgroup_root.
    let mut list = node.conflist();
    list["plugins"][1]
        .as_object_mut()
        .unwrap()
        .remove("cgroup_root");
    *node.installed_conflist() = Some(list);
    let agent = node.start_agent_with("auto", &["--fallback", "nftables"]);
    let mut pod = node.pod("on-v1", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut pod).expect("ADD on a cgroup v1 node");
    let tables = run(std::process::Command::new("ip").args([
        "netns",
        "exec",
        &pod.netns.name,
        "nft",
        "list",
        "tables",
    ]));
    assert!(tables.contains("istio-proxy-nat"), "{tables}");
    let body = agent.checked_metrics();
    assert!(
        body.lines().any(|l| l.starts_with("capture_pod_fallback{")
            && l.contains("pod=\"on-v1\"")
            && l.contains("cause=\"cgroup_v1\"")),
        "{body}"
    );
    node.check(&pod).expect("CHECK");
    node.del(&pod).expect("DEL");
}
