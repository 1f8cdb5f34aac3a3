//! The agent's capabilities, measured rather than guessed: deploy/capture.yaml's
//! `capabilities.add` is the set capture-user's `privileges::NEEDS` names (less those another of
//! the set stands for); an agent holding that set and nothing else (and `SYS_RESOURCE` on kernels
//! before 5.11, as the docs say) becomes ready, captures a pod both ways and takes a node over
//! from another build; an agent without any one of them stays not ready and names it; and the
//! operation each is for fails without it.

use std::{
    os::unix::process::CommandExt as _,
    path::{Path, PathBuf},
    process::Command,
};

use capture_tests::{
    cni::{CgroupDriver, Node, MESHED},
    daemonset,
    guards::{in_netns, ChildGuard},
    probe::{connect_with, Who},
    topology::{capture_bin, Topology, OWN_PID_NAMESPACE, POD_IP4},
    variant_capture_bin,
};
use capture_user::privileges::{to_add, NEEDS};

/// The agent container's `capabilities.add`, as the manifest says it.
fn manifest_capabilities(node: &Node) -> Vec<String> {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml");
    let config_maps = node.scratch_file("configmaps/none");
    let pod = daemonset::node_agent(&manifest, "127.0.0.1", config_maps.parent().unwrap());
    let agent = pod
        .containers
        .iter()
        .find(|c| c.name == "agent")
        .expect("the agent container");
    assert_eq!(
        agent.capabilities_drop,
        ["ALL"],
        "the agent drops every capability first"
    );
    let mut added = agent.capabilities_add.clone();
    added.sort();
    added
}

/// What the agent holds on this node as the manifest and docs say to run it: the manifest's
/// list, and `SYS_RESOURCE` on kernels before 5.11 (which count BPF memory against
/// `RLIMIT_MEMLOCK`; docs/how-it-works/compatibility.md).
fn restricted_set(node: &Node) -> Vec<String> {
    let mut set = manifest_capabilities(node);
    let release = capture_user::accel::kernel_release();
    if !capture_user::privileges::kernel_charges_memcg(&release) {
        set.push("SYS_RESOURCE".to_string());
    }
    set
}

/// setpriv's `--bounding-set` for exactly `keep`, or for everything but `drop`.
fn bounding_set(keep: Option<&[String]>, drop: Option<&str>) -> String {
    match (keep, drop) {
        (Some(keep), _) => std::iter::once("-all".to_string())
            .chain(keep.iter().map(|c| format!("+{}", c.to_lowercase())))
            .collect::<Vec<_>>()
            .join(","),
        (None, Some(drop)) => format!("-{}", drop.to_lowercase()),
        (None, None) => "+all".to_string(),
    }
}

/// setpriv with the bounding set (and so, for root, the capabilities the next program execs
/// with) cut as `bounding_set` says, no inheritable ones carried over; the program follows.
fn setpriv(keep: Option<&[String]>, drop: Option<&str>) -> Vec<String> {
    vec![
        "setpriv".to_string(),
        "--inh-caps=-all".to_string(),
        format!("--bounding-set={}", bounding_set(keep, drop)),
        "--".to_string(),
    ]
}

/// `capture` run through `setpriv(keep, drop)`.
fn agent_with(keep: Option<&[String]>, drop: Option<&str>) -> Command {
    let wrapper = setpriv(keep, drop);
    let mut cmd = Command::new(&wrapper[0]);
    cmd.args(&wrapper[1..]).arg(capture_bin());
    cmd
}

#[test]
fn the_manifest_adds_exactly_the_capabilities_the_agent_needs() {
    let node = Node::new();
    let mut needed: Vec<String> = to_add().iter().map(|c| c.name()).collect();
    needed.sort();
    assert_eq!(manifest_capabilities(&node), needed);
    // CAP_BPF and CAP_PERFMON are needed, and CAP_SYS_ADMIN, which the agent holds for setns,
    // stands for them.
    for need in NEEDS.iter().filter(|n| n.instead.is_some()) {
        assert!(needed.contains(&need.instead.unwrap().name()), "{need:?}");
    }
}

#[test]
fn an_agent_with_only_the_manifests_capabilities_captures_a_pod() {
    let node = Node::new();
    let keep = restricted_set(&node);
    let agent = node.spawn_agent_as(agent_with(Some(&keep), None), "auto", &[]);
    agent.wait_ready();
    let mut pod = node.pod("restricted", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut pod).expect("ADD under the restricted agent");
    let _servers = pod.start_servers();
    let got = connect_with(node.client(), &format!("{}:8080", pod.ip()));
    got.assert_served_by("inbound", "inbound under the restricted agent");
    let got = connect_with(pod.app_client(), "10.0.0.9:80");
    got.assert_served_by("outbound", "outbound under the restricted agent");
    node.del(&pod).expect("DEL under the restricted agent");
}

#[test]
fn an_agent_without_one_of_its_capabilities_names_it_and_stays_not_ready() {
    let node = Node::new();
    for capability in manifest_capabilities(&node) {
        let agent = node.spawn_agent_as(agent_with(None, Some(&capability)), "auto", &[]);
        let (code, body) = agent.wait_answer("/readyz");
        assert_eq!(code, 503, "without {capability}: {body}");
        assert!(
            body.contains(&format!("CAP_{capability} (for ")),
            "without {capability}, /readyz names it and what for: {body}"
        );
        assert!(
            body.contains(&format!("add {capability}")),
            "and says what to do: {body}"
        );
        drop(agent);
    }
}

/// `setpriv` as a `capture_wrapper`: the capabilities `capture` execs with, less `drop`.
fn without(drop: &str) -> Vec<String> {
    setpriv(None, Some(drop))
}

/// Runs `attach` of a fresh pod through `capture` without `capability` (`extra` arguments, an
/// environment variable) and checks that it fails and that its error names the capability.
fn attach_fails_without(capability: &str, extra: &[&str], env: Option<(&'static str, &str)>) {
    let mut topo = Topology::new();
    topo.capture_wrapper = without(capability);
    if let Some((key, value)) = env {
        topo.capture_env.push((key, value.to_string()));
    }
    let out = topo.try_attach(extra);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "attach {extra:?} without {capability} succeeded: the capability is not needed for it"
    );
    assert!(
        stderr.contains(&format!("CAP_{capability} (for ")),
        "without {capability}, the error names it: {stderr}"
    );
}

/// The operations the table names, run by the CLI (which checks nothing before it tries) without
/// the capability they are listed under: each fails, and its error names the capability. So each
/// of the manifest's capabilities is needed, not only listed.
#[test]
fn each_capability_is_needed_by_the_operation_it_is_for() {
    // Attaching the programs to the pod's cgroup and entering the pod's netns.
    attach_fails_without("NET_ADMIN", &[], None);
    attach_fails_without("SYS_ADMIN", &[], None);
    // iptables-legacy's tables, read and written through a raw socket.
    attach_fails_without(
        "NET_RAW",
        &["--mode", "iptables"],
        Some(("CAPTURE_IPTABLES", "legacy")),
    );
    // A netns named as a process of another uid's (a runtime's /proc/PID/ns/net).
    let mut topo = Topology::new();
    let holder = ChildGuard::spawn(in_netns(&topo.pod.netns.path(), "setpriv").args([
        "--reuid=1000",
        "--regid=1000",
        "--clear-groups",
        "sleep",
        "60",
    ]));
    let netns = format!("/proc/{}/ns/net", holder.pid());
    topo.capture_wrapper = without("SYS_PTRACE");
    let cgroup = topo.pod.cgroup.path.to_str().unwrap().to_string();
    let out = topo.capture(&[
        "attach", "--netns", &netns, "--cgroup", &cgroup, "--pod-ip", POD_IP4,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "attach through {netns}: {stderr}");
    assert!(stderr.contains("CAP_SYS_PTRACE (for "), "{stderr}");
    // The kernel probe's scratch cgroup, where the cgroup2 root is read-only to its owner (systemd's
    // hybrid layout, as on the CI machine); elsewhere root writes it without DAC_OVERRIDE.
    let root = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
    let mode = std::fs::metadata(&root)
        .expect("the cgroup2 root")
        .permissions();
    if std::os::unix::fs::PermissionsExt::mode(&mode) & 0o200 == 0 {
        let mut doctor = Topology::new();
        doctor.capture_wrapper = without("DAC_OVERRIDE");
        let out = doctor.capture(&["doctor"]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(stdout.contains("Permission denied"), "{stdout}");
        assert!(stdout.contains("[FAIL] capabilities"), "{stdout}");
        assert!(stdout.contains("CAP_DAC_OVERRIDE (for "), "{stdout}");
    }
}

/// The agent of `bin` as the manifest restricts it: a PID namespace of its own (unshare, whose
/// process group the test signals, since unshare ignores SIGTERM itself) and only `keep`.
fn restricted_agent(bin: &Path, keep: &[String]) -> Command {
    let mut cmd = Command::new("unshare");
    cmd.args(["--pid", "--fork", "--kill-child", "--"])
        .args(setpriv(Some(keep), None))
        .arg(bin)
        .process_group(0);
    cmd
}

/// Stops an agent started by `restricted_agent` as a rolling update does (SIGTERM to it).
fn stop_restricted(agent: &mut capture_tests::cni::Agent) {
    let group = nix::unistd::Pid::from_raw(i32::try_from(agent.pid()).expect("a pid"));
    let _ = nix::sys::signal::killpg(group, nix::sys::signal::Signal::SIGTERM);
    agent.stop();
}

/// An upgrade as the DaemonSet rolls it, both agents restricted as the manifest restricts them:
/// the other build's agent takes the node over in place, a connection held across it keeps its
/// path, and new connections both ways go through the proxy.
#[test]
fn a_restricted_agent_takes_the_node_over_from_another_build_keeping_its_connections() {
    let node = Node::new();
    let keep = restricted_set(&node);
    let topo = Topology::numbered(node.dirs.shared(), 1);
    topo.attach(&[]);
    let mut topo = topo;
    topo.start_all();
    let mut old = node.spawn_agent_as(restricted_agent(&capture_bin(), &keep), "ebpf", &[]);
    old.wait_ready();
    let held = topo.spawn_holder(&Who::app(), "10.0.0.5:80", false);

    stop_restricted(&mut old);
    let new_bin = variant_capture_bin();
    let mut new = node.spawn_agent_as(restricted_agent(&new_bin, &keep), "ebpf", &[]);
    new.wait_ready();
    // Read by the new build: the old one cannot read the maps of another layout.
    let status = topo.status_by(&new_bin);
    let (old_build, new_build) = (
        topo.status_by(&capture_bin())["build"].to_string(),
        status["build"].to_string(),
    );
    assert_ne!(old_build, new_build, "the variant is another build");
    assert_eq!(status["node_build"], status["build"], "{status}");
    assert_eq!(
        status["node_features"],
        serde_json::to_value(capture_tests::kernel::features()).expect("features as JSON"),
        "the build that took over adapted its programs to everything the kernel has: {status}"
    );
    let pod = &status["pods"][0];
    assert_eq!(pod["in_force"], true, "{status}");
    assert_eq!(pod["program_build"], status["build"], "{status}");

    let out = held.release_and_wait("go\n");
    let seen: serde_json::Value = serde_json::from_str(out.trim()).expect("the holder's JSON");
    for phase in [&seen["first"], &seen["second"]] {
        assert_eq!(phase["reply"]["server"], "outbound", "{seen}");
        assert_eq!(phase["reply"]["orig"], "10.0.0.5:80", "{seen}");
    }
    let out = topo.tcp(&Who::app(), "10.0.0.5:80");
    out.assert_served_by("outbound", "after the restricted takeover");
    let to = format!("{}:8080", topo.ip4);
    let inbound = topo.connect_from_remote(&to);
    inbound.assert_served_by("inbound", "after the restricted takeover");
    stop_restricted(&mut new);
}

/// An agent in a PID namespace of its own sweeps only the scratch cgroups of processes the node
/// no longer runs: another process's (a previous agent mid-probe, a CLI run on the node, here
/// this test), named by its node PID, stays; a dead one's goes. Judged by the agent's own PID
/// namespace, where no other process exists, both went: a CI run lost a test's cgroup so.
#[test]
fn an_agent_in_its_own_pid_namespace_sweeps_only_the_scratch_cgroups_of_dead_processes() {
    let root = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
    let mut finished = Command::new("cat").arg("/dev/null").spawn().expect("cat");
    let dead = finished.id();
    finished.wait().expect("cat exits");
    let scratch = |pid: u32| root.join(format!("capture-sweep-{pid}-0"));
    let (live, gone) = (scratch(std::process::id()), scratch(dead));
    for dir in [&live, &gone] {
        std::fs::create_dir(dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
    }
    let node = Node::new();
    let mut cmd = Command::new(OWN_PID_NAMESPACE[0]);
    cmd.args(&OWN_PID_NAMESPACE[1..]).arg(capture_bin());
    let agent = node.start_agent_as(cmd, "ebpf");
    // The sweep runs as the agent starts, then every 10 s.
    let swept = capture_tests::wait::poll_until(std::time::Duration::from_secs(15), || {
        if gone.exists() {
            Err(())
        } else {
            Ok(())
        }
    });
    let kept = live.exists();
    drop(agent);
    let _ = std::fs::remove_dir(&live);
    let _ = std::fs::remove_dir(&gone);
    assert!(
        swept.is_ok(),
        "the dead process's {} was swept",
        gone.display()
    );
    assert!(kept, "this live process's {} was kept", live.display());
}
