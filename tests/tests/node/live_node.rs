//! A node that has been running for a while: pod addresses change hands, and late teardowns of
//! old pods must not take capture away from the pods that hold those addresses now.

use std::{
    os::fd::AsFd as _,
    path::Path,
    time::{Duration, Instant},
};

use capture_tests::{
    cni::{error_code as code, CgroupDriver, Node, MESHED},
    cni_neighbours::rewrite_whole,
    guards::{ChildGuard, ReadOnlyBind},
    probe::{Outcome, Who},
    topology::{
        capture_bin, cgroup_programs, only_pod_links, Topology, OWN_PID_NAMESPACE,
        POD_CGROUP_HOOKS, POD_IP4,
    },
};
use capture_user::ebpf::sys;

/// The pod in `topo`'s status (the node's only pod with that netns).
fn pod_status(topo: &Topology) -> serde_json::Value {
    let netns = topo.pod.netns.path().display().to_string();
    topo.status()["pods"]
        .as_array()
        .expect("pods")
        .iter()
        .find(|p| p["netns"] == netns.as_str())
        .cloned()
        .unwrap_or_else(|| panic!("no pod with netns {netns}"))
}

fn assert_inbound_captured(got: &Outcome, to: &str, context: &str) {
    got.assert_served_by("inbound", context);
    assert_eq!(got.orig().as_deref(), Some(to), "{context}: {got:?}");
}

/// Kubernetes hands a deleted pod's IP to a new pod quickly; the old pod's DEL (or GC) may come
/// after the new pod's ADD. The node-wide address entry belongs to the pod that wrote it last.
#[test]
fn a_late_detach_of_the_old_holder_of_an_address_leaves_the_new_one_captured() {
    let to = format!("{POD_IP4}:8080");
    let old = Topology::new();
    old.attach(&[]);
    let mut new = Topology::with_dirs(old.dirs.shared());
    new.attach(&[]);
    new.start_all();
    assert_inbound_captured(&new.connect_from_remote(&to), &to, "new pod attached");

    // CHECK of the old pod says its address is gone; the new pod's is whole.
    let old_status = pod_status(&old);
    assert_eq!(old_status["in_force"], false, "{old_status}");
    assert!(
        old_status["missing"].to_string().contains(POD_IP4),
        "the old pod's status names the address it lost: {old_status}"
    );
    assert_eq!(pod_status(&new)["in_force"], true);

    let out = old.detach();
    assert!(out.status.success(), "{out:?}");
    assert_inbound_captured(
        &new.connect_from_remote(&to),
        &to,
        "after the old pod's late detach",
    );
    let new_status = pod_status(&new);
    assert_eq!(new_status["in_force"], true, "{new_status}");
}

/// The plugins of the node's active conflist, by type.
fn chain(file: &Path) -> Vec<String> {
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(file).unwrap_or_default())
            .unwrap_or_default();
    conf["plugins"]
        .as_array()
        .map(|p| {
            p.iter()
                .map(|p| p["type"].as_str().unwrap_or_default().to_string())
                .collect()
        })
        .unwrap_or_default()
}

/// Waits up to `limit` for `done`; how long it took.
fn within(limit: Duration, mut done: impl FnMut() -> bool) -> Option<Duration> {
    let start = Instant::now();
    while start.elapsed() < limit {
        if done() {
            return Some(start.elapsed());
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// The node's agent, keeping capture-cni chained in the node's configuration directory.
fn agent_keeping_the_chain(node: &Node) -> capture_tests::cni::Agent {
    let conf_dir = node.conf_dir();
    node.start_agent_with(
        "ebpf",
        &[
            "--watch-cni-config",
            "--cni-conf-dir",
            conf_dir.to_str().unwrap(),
            "--cni-bin-dir",
            node.plugin_dir.to_str().unwrap(),
        ],
    )
}

/// Calico and AWS VPC CNI rewrite their CNI configuration whole at each start and drop what they
/// do not know; the agent puts capture-cni back at once, without calling it a fight, and only
/// uninstall-cni takes it out (the node is then not ready, as istio-cni's is not unchained).
#[test]
fn the_agent_keeps_capture_cni_chained_when_the_network_plugin_rewrites_its_config() {
    // The design says within a second (four checks a second); emulated kernels get slack.
    const LIMIT: Duration = Duration::from_secs(3);
    let node = Node::new();
    let installed = node.install_cni();
    let conf_dir = node.conf_dir();
    let file = conf_dir.join("10-bridge.conflist");
    let agent = agent_keeping_the_chain(&node);
    let mut own = installed.clone();
    own["plugins"].as_array_mut().unwrap().truncate(1);

    // Rewritten in place (renamed over), without capture-cni.
    rewrite_whole(&file, &own);
    let took = within(LIMIT, || chain(&file) == ["bridge", "capture-cni"]);
    assert!(took.is_some(), "not chained again: {:?}", chain(&file));
    eprintln!("chained again after {took:?}");

    // Replaced by a configuration under a name that sorts first, so it becomes the active one.
    let replacement = conf_dir.join("05-replacement.conflist");
    let mut other = own.clone();
    other["name"] = "replacement".into();
    rewrite_whole(&replacement, &other);
    assert!(
        within(LIMIT, || chain(&replacement) == ["bridge", "capture-cni"]).is_some(),
        "the new active configuration was not chained: {:?}",
        chain(&replacement)
    );
    let metrics = agent.checked_metrics();
    assert!(
        metrics.contains("\ncapture_cni_rechained_total 2\n"),
        "both re-chainings counted: {metrics}"
    );
    for line in ["\ncapture_cni_chained 1\n", "\ncapture_cni_chain_fight 0\n"] {
        assert!(metrics.contains(line), "{line:?} in {metrics}");
    }
    let report = &node.status()["cni_chain"];
    assert_eq!(report["chained"], true, "{report}");
    assert!(
        report["fight"].is_null(),
        "a rewrite at a start is no fight: {report}"
    );

    // uninstall-cni is the way out, and the watcher respects it.
    node.uninstall_cni().expect("uninstall-cni");
    let out_of_both = || chain(&replacement) == ["bridge"] && chain(&file) == ["bridge"];
    assert!(
        within(LIMIT, out_of_both).is_some(),
        "still chained after uninstall-cni: {:?} {:?}",
        chain(&replacement),
        chain(&file)
    );
    std::thread::sleep(Duration::from_secs(1));
    assert!(out_of_both(), "chained again after uninstall-cni");
    let (code, why) = agent.get("/readyz").expect("/readyz");
    assert!(
        code == 503 && why.contains("capture-cni is not installed"),
        "{code} {why}"
    );
    assert!(agent
        .checked_metrics()
        .contains("\ncapture_cni_chained 0\n"));
}

/// A configuration directory that changes hundreds of times a second, its active file written
/// without capture-cni each time: the agent chains it again a few times, growing its wait, names
/// the fight and stays healthy; it never rewrites in step with the writer.
#[test]
fn a_configuration_rewritten_hundreds_of_times_a_second_is_not_fought() {
    let node = Node::new();
    let installed = node.install_cni();
    let conf_dir = node.conf_dir();
    let file = conf_dir.join("10-bridge.conflist");
    let agent = agent_keeping_the_chain(&node);
    let mut own = installed.clone();
    own["plugins"].as_array_mut().unwrap().truncate(1);
    let start = Instant::now();
    let mut writes = 0;
    while start.elapsed() < Duration::from_secs(4) {
        rewrite_whole(&file, &own);
        writes += 1;
        std::thread::sleep(Duration::from_millis(3));
    }
    let metrics = agent.checked_metrics();
    let rechained: u64 = metrics
        .lines()
        .find_map(|l| l.strip_prefix("capture_cni_rechained_total "))
        .and_then(|v| v.trim().parse().ok())
        .expect("the re-chaining counter");
    // At 0, 1 and 3 s; the next would be at 7 s.
    assert!(
        (1..=3).contains(&rechained),
        "{rechained} re-chainings against {writes} rewrites in 4 s"
    );
    assert!(
        metrics.contains("\ncapture_cni_chain_fight 1\n"),
        "{metrics}"
    );
    assert_eq!(agent.get("/healthz").map(|(code, _)| code), Some(200));
}

/// With the agent down, DEL of a pod capture never captured succeeds at once, so the runtime can
/// tear down every unmeshed pod of the node; only a captured pod waits (code 11) until the agent
/// is back to release it, so nothing of it stays in the kernel.
#[test]
fn del_without_the_agent_waits_only_for_captured_pods() {
    let node = Node::new();
    let mut agent = node.start_agent("ebpf");
    let mut meshed = node.pod("meshed", CgroupDriver::Cgroupfs, MESHED);
    let mut plain = node.pod("plain", CgroupDriver::Cgroupfs, &[]);
    let mut system = node.pod("system", CgroupDriver::Systemd, MESHED);
    system.namespace = "kube-system".into();
    for pod in [&mut meshed, &mut plain, &mut system] {
        node.add(pod)
            .unwrap_or_else(|e| panic!("ADD {}: {e}", pod.name));
    }
    assert_eq!(cgroup_programs(&meshed.cgroup).len(), POD_CGROUP_HOOKS);
    agent.kill_hard();

    for pod in [&plain, &system] {
        node.del(pod)
            .unwrap_or_else(|e| panic!("DEL {} without the agent: {e}", pod.name));
    }
    // A pod whose ADD never reached the agent was never captured either.
    let mut late = node.pod("late", CgroupDriver::Cgroupfs, MESHED);
    let err = node.add(&mut late).expect_err("ADD without the agent");
    assert_eq!(code(&err), Some(11), "{err}");
    node.del(&late)
        .expect("DEL of a pod whose ADD failed closed");

    let err = node
        .del(&meshed)
        .expect_err("DEL of a captured pod without the agent");
    assert_eq!(code(&err), Some(11), "{err}");
    assert!(
        err["error"]["details"].to_string().contains("captured"),
        "{err}"
    );
    assert_eq!(
        cgroup_programs(&meshed.cgroup).len(),
        POD_CGROUP_HOOKS,
        "a captured pod's DEL released nothing without the agent, and left it captured"
    );

    let _agent = node.start_agent("ebpf");
    node.del(&meshed).expect("DEL once the agent is back");
    assert!(cgroup_programs(&meshed.cgroup).is_empty());
    assert!(
        std::fs::read_dir(node.dirs.state.join("cni-claims")).map_or(0, Iterator::count) == 0,
        "claims left behind"
    );
}

/// Inbound and outbound both reach a proxy whose listeners predate the attach.
fn assert_proxy_reached_both_ways(topo: &Topology, context: &str) {
    let to = format!("{POD_IP4}:8080");
    assert_inbound_captured(&topo.connect_from_remote(&to), &to, context);
    let out = topo.tcp(&Who::app(), "10.0.0.5:80");
    out.assert_served_by("outbound", context);
    assert_eq!(out.orig().as_deref(), Some("10.0.0.5:80"), "{context}");
}

/// The proxy listens before capture is attached, and keeps running while capture is detached
/// and attached again: its listeners are found and registered each time.
#[test]
fn a_running_proxy_survives_attach_detach_and_attach_again() {
    let mut topo = Topology::new();
    topo.start_all();
    topo.attach(&[]);
    assert_proxy_reached_both_ways(&topo, "attached under a running proxy");
    let out = topo.detach();
    assert!(out.status.success(), "{out:?}");
    let to = format!("{POD_IP4}:8080");
    topo.connect_from_remote(&to)
        .assert_served_by("app", "detached");
    topo.attach(&[]);
    assert_proxy_reached_both_ways(&topo, "attached again");
}

/// The pod's remote, app and outbound proxy, and an inbound proxy of two `SO_REUSEPORT` listeners
/// (`inbound-0`, `inbound-1`), each on 0.0.0.0 and [::].
fn start_proxy_with_a_reuseport_group(topo: &mut Topology) -> Vec<ChildGuard> {
    topo.start_remote();
    topo.start_app();
    topo.start_proxy_on(&[("outbound", 15001)]);
    vec![
        topo.spawn_reuseport_listener("inbound-0", 15006),
        topo.spawn_reuseport_listener("inbound-1", 15006),
    ]
}

/// Envoy listens with `SO_REUSEPORT`, one socket per worker. Every one of the group is registered,
/// whether it predates the attach or not, so inbound keeps working while any of them remains;
/// with none left, inbound is refused, never passed to the app.
#[test]
fn a_reuseport_group_keeps_inbound_working_while_one_listener_remains() {
    let mut topo = Topology::new();
    let mut group = start_proxy_with_a_reuseport_group(&mut topo);
    topo.attach(&[]);
    group.push(topo.spawn_reuseport_listener("inbound-2", 15006));
    group.push(topo.spawn_reuseport_listener("inbound-3", 15006));
    let to = format!("{POD_IP4}:8080");
    let served_by = |topo: &Topology| {
        let got = topo.connect_from_remote(&to);
        assert_eq!(got.orig().as_deref(), Some(to.as_str()), "{got:?}");
        got.server().expect("a server answered")
    };
    assert!(served_by(&topo).starts_with("inbound-"));

    // Close three, among them both that predate the attach.
    let last = group.remove(2);
    drop(group);
    for round in 0..10 {
        assert_eq!(served_by(&topo), "inbound-2", "round {round}");
    }
    drop(last);
    let got = topo.connect_from_remote(&to);
    assert_ne!(got.server().as_deref(), Some("app"), "{got:?}");
    assert!(got.server().is_none(), "refused with no listener: {got:?}");
}

/// An agent in a PID namespace of its own (a DaemonSet without `hostPID`) cannot take the proxy's
/// descriptors: the kernel registers the listeners that predate the attach instead, each member of
/// a `SO_REUSEPORT` group in a slot of its own, and the outbound listener keeps telling where its
/// connections were going.
#[test]
fn an_agent_outside_the_pods_pid_namespace_registers_the_listeners_that_predate_the_attach() {
    let mut topo = Topology::new();
    topo.capture_wrapper = OWN_PID_NAMESPACE.map(String::from).to_vec();
    let mut group = start_proxy_with_a_reuseport_group(&mut topo);
    topo.attach(&[]);
    // Two members each on 0.0.0.0 and on [::].
    assert_eq!(
        listener_map_keys(&topo.dirs.bpffs),
        4,
        "registered listeners"
    );
    let out = topo.tcp(&Who::app(), "10.0.0.5:80");
    out.assert_served_by("outbound", "outbound under an agent without the pod's PIDs");
    assert_eq!(out.orig().as_deref(), Some("10.0.0.5:80"));
    let to = format!("{POD_IP4}:8080");
    drop(group.remove(0));
    for round in 0..5 {
        let got = topo.connect_from_remote(&to);
        assert_eq!(
            got.server().as_deref(),
            Some("inbound-1"),
            "round {round}: {got:?}"
        );
        assert_eq!(got.orig().as_deref(), Some(to.as_str()), "{got:?}");
    }
    // Attached again: the one left is registered once, not twice.
    assert!(topo.detach().status.success());
    topo.attach(&[]);
    assert_eq!(
        listener_map_keys(&topo.dirs.bpffs),
        2,
        "after attaching again"
    );
    let got = topo.connect_from_remote(&to);
    assert_eq!(
        got.server().as_deref(),
        Some("inbound-1"),
        "attached again: {got:?}"
    );
}

/// How many entries the node's listener map holds.
fn listener_map_keys(bpffs: &Path) -> usize {
    let path = capture_tests::topology::node_pin_dir(bpffs).join("maps/INBOUND_LISTENERS");
    let map = sys::obj_get(&path).expect("the listener map's pin");
    let mut key = None::<[u8; 16]>;
    let mut count = 0;
    loop {
        let mut next = [0u8; 16];
        let more = sys::map_next_key(map.as_fd(), key.as_ref().map(|k| &k[..]), &mut next)
            .expect("walking the listener map");
        if !more {
            return count;
        }
        count += 1;
        key = Some(next);
    }
}

/// The node's program and map pins are lost (removed by hand, a bpffs that was not the host's)
/// while the pods' links remain: the agent loads the programs afresh, writes every pod's entries
/// into the new maps, then moves the pods' links onto the new programs, so they stay captured.
#[test]
fn an_agent_that_finds_the_node_pins_gone_restores_every_pod() {
    let node = Node::new();
    let mut topo = Topology::with_dirs(node.dirs.shared());
    topo.start_all();
    topo.attach(&[]);
    assert_proxy_reached_both_ways(&topo, "attached");
    std::fs::remove_dir_all(node.dirs.bpffs.join("builds")).expect("removing the node's pins");
    let mut agent = node.spawn_agent_of(&capture_bin(), "ebpf", &[]);
    agent.wait_ready();
    assert_proxy_reached_both_ways(&topo, "after the agent reloaded the node's programs");
    let status = pod_status(&topo);
    assert_eq!(status["in_force"], true, "{status}");
    assert_eq!(
        status["program_build"],
        topo.status()["node_build"],
        "{status}"
    );

    // The pod's links are lost too: the next agent start links the recorded pod again.
    agent.stop();
    for dir in std::fs::read_dir(node.dirs.bpffs.join("pods"))
        .expect("link pins")
        .flatten()
    {
        for link in std::fs::read_dir(dir.path())
            .expect("a pod's links")
            .flatten()
        {
            if let Ok(fd) = sys::obj_get(&link.path()) {
                let _ = sys::link_detach(fd.as_fd());
            }
        }
        std::fs::remove_dir_all(dir.path()).expect("removing a pod's link pins");
    }
    assert_eq!(
        pod_status(&topo)["in_force"],
        false,
        "the pod lost its links"
    );
    let agent = node.spawn_agent_of(&capture_bin(), "ebpf", &[]);
    agent.wait_ready();
    assert_proxy_reached_both_ways(&topo, "after the agent linked the pod again");
    assert_eq!(pod_status(&topo)["in_force"], true);
}

#[test]
fn a_del_that_cannot_remove_the_pins_fails_and_the_agent_releases_the_pod_later() {
    let node = Node::new();
    let agent = node.start_agent("ebpf");
    let mut pod = node.pod("sticky", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut pod).expect("ADD");
    let links = only_pod_links(&node.dirs.bpffs);
    let read_only = ReadOnlyBind::new(&links);

    let err = node.del(&pod).expect_err("DEL with the pod's pins stuck");
    assert!(
        err["error"]["details"]
            .as_str()
            .is_some_and(|d| d.contains("tried again")),
        "{err}"
    );
    let metrics = agent.checked_metrics();
    assert!(
        metrics
            .lines()
            .any(|l| l.starts_with("capture_pod_in_force{")
                && l.contains("pod=\"sticky\"")
                && l.ends_with(" 0")),
        "the pod is reported as not in force:\n{metrics}"
    );

    // Once the pins can go, the agent's own retry releases the pod, with no DEL from anyone.
    drop(read_only);
    let records = node.dirs.state.join("pods");
    capture_tests::wait::wait_for(
        Duration::from_mins(1),
        "the agent to release the pod",
        || std::fs::read_dir(&records).is_ok_and(|mut d| d.next().is_none()),
    );
    assert!(cgroup_programs(&pod.cgroup).is_empty());
    assert!(
        std::fs::read_dir(node.dirs.bpffs.join("pods")).is_ok_and(|mut d| d.next().is_none()),
        "link pins left"
    );
    node.del(&pod)
        .expect("the runtime's DEL again, now a no-op");
}
