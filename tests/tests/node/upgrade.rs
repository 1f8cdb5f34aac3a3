//! Upgrading and rolling back a live node, as a DaemonSet's rolling update does it: the agent of
//! one build stops, the agent of another starts over the pins the first left, while the node's
//! pods keep opening connections and hold others open. The other build is the next-layout variant
//! (`cargo xtask test` builds it): its pod-config and counter maps have another layout, so the
//! upgrade rebuilds one and migrates the other, and the rollback rebuilds one and resets the other.

use std::{
    os::fd::AsFd as _,
    path::Path,
    process::Command,
    sync::{
        atomic::{AtomicBool, AtomicUsize, Ordering},
        Mutex,
    },
    time::Duration,
};

use capture_tests::{
    agent::READY_PATIENCE,
    cni::{Agent, Node},
    guards::{saved_rules_with, ChildGuard},
    previous_release_capture_bin,
    probe::Who,
    topology::{capture_bin, node_pin_dir, Topology},
    variant_capture_bin,
};
use capture_user::ebpf::sys;
use serde_json::Value;

const PODS: u8 = 20;
const NAMESERVER: &str = "10.96.0.10";

/// Every fourth pod runs on iptables (auto mode's fallback, or a pod annotated so).
fn on_iptables(i: u8) -> bool {
    i % 4 == 3
}

/// `capture` of the build `bin`, over the node's directories.
fn capture_of(bin: &Path, topo: &Topology) -> Command {
    let mut cmd = Command::new(bin);
    cmd.arg("--bpffs")
        .arg(&topo.dirs.bpffs)
        .arg("--state-dir")
        .arg(&topo.dirs.state);
    cmd
}

/// The kernel's ids of the programs, maps or links pinned in `dir` (`kind` names which, as
/// bpftool does).
fn pinned_ids(kind: &str, dir: &Path) -> Vec<u64> {
    let mut ids: Vec<u64> = std::fs::read_dir(dir)
        .expect("pin dir")
        .flatten()
        .map(|entry| {
            let fd = sys::obj_get(&entry.path())
                .unwrap_or_else(|e| panic!("{kind} {}: {e}", entry.path().display()));
            u64::from(sys::obj_id(fd.as_fd()).expect("object id"))
        })
        .collect();
    ids.sort_unstable();
    ids
}

/// Those of `ids` that bpftool still lists after a few seconds (the kernel frees objects after
/// a grace period).
fn still_loaded(kind: &str, ids: &[u64]) -> Vec<u64> {
    let loaded = || -> Vec<u64> {
        let out = Command::new("bpftool")
            .args(["-j", kind, "show"])
            .output()
            .expect("bpftool");
        let listed: Vec<Value> = serde_json::from_slice(&out.stdout).unwrap_or_default();
        ids.iter()
            .copied()
            .filter(|id| listed.iter().any(|v| v["id"].as_u64() == Some(*id)))
            .collect()
    };
    for _ in 0..50 {
        if loaded().is_empty() {
            break;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    loaded()
}

/// The links of every pod (ids), in pin order.
fn link_ids(bpffs: &Path) -> Vec<u64> {
    let mut ids = Vec::new();
    for pod in std::fs::read_dir(bpffs.join("pods"))
        .expect("pods")
        .flatten()
    {
        ids.extend(pinned_ids("link", &pod.path()));
    }
    ids
}

/// The names of the link pins of every pod (each named by its program).
fn pod_link_names(bpffs: &Path) -> Vec<String> {
    let pods = std::fs::read_dir(bpffs.join("pods")).expect("pods");
    pods.flatten()
        .flat_map(|pod| {
            std::fs::read_dir(pod.path())
                .into_iter()
                .flatten()
                .flatten()
        })
        .map(|link| link.file_name().to_string_lossy().into_owned())
        .collect()
}

/// Checks the whole node after a takeover by `bin`: every pod in force, every ebpf pod on `build`.
fn assert_node_on(bin: &Path, pods: &[Topology], build: &str, phase: &str) {
    let status = pods[0].status_by(bin);
    assert_eq!(status["node_build"], build, "{phase}: {status}");
    let listed = status["pods"].as_array().expect("pods");
    assert_eq!(listed.len(), pods.len(), "{phase}: {status}");
    for pod in listed {
        assert_eq!(pod["in_force"], true, "{phase}: {pod}");
        if pod["mode"] == "ebpf" {
            assert_eq!(pod["program_build"], build, "{phase}: {pod}");
        } else {
            assert_eq!(pod["program_build"], Value::Null, "{phase}: {pod}");
        }
    }
}

/// One round of traffic through pod `topo`: outbound to a remote service, inbound to the app,
/// and a DNS query; every answer must come from the proxy with the original destination.
fn exchange(topo: &Topology) -> Result<(), String> {
    let out = topo.tcp(&Who::app(), "10.0.0.5:80");
    if out.server().as_deref() != Some("outbound") || out.orig().as_deref() != Some("10.0.0.5:80") {
        return Err(format!("outbound from {}: {out:?}", topo.ip4));
    }
    let to = format!("{}:8080", topo.ip4);
    let inbound = topo.connect_from_remote(&to);
    if inbound.server().as_deref() != Some("inbound") || inbound.orig().as_deref() != Some(&to) {
        return Err(format!("inbound to {to}: {inbound:?}"));
    }
    Ok(())
}

/// A connection held open across the takeovers, and what it must still see afterwards.
struct Held {
    guard: ChildGuard,
    pod: String,
    udp: bool,
}

/// In every pod, an outbound TCP connection and a DNS exchange over a connected UDP socket,
/// held open.
fn hold_connections(pods: &[Topology]) -> Vec<Held> {
    pods.iter()
        .flat_map(|topo| {
            [
                Held {
                    guard: topo.spawn_holder(&Who::app(), "10.0.0.5:80", false),
                    pod: topo.ip4.clone(),
                    udp: false,
                },
                Held {
                    guard: topo.spawn_holder(&Who::app(), &format!("{NAMESERVER}:53"), true),
                    pod: topo.ip4.clone(),
                    udp: true,
                },
            ]
        })
        .collect()
}

fn check_held(held: Held) {
    let out = held.guard.release_and_wait("go\n");
    let v: Value =
        serde_json::from_str(out.trim()).unwrap_or_else(|e| panic!("{}: {e}: {out}", held.pod));
    let (first, second) = (&v["first"], &v["second"]);
    assert_eq!(second["ok"], true, "{}: {v}", held.pod);
    if held.udp {
        // The DNS proxy's reply still comes from the nameserver, as the app asked it.
        let ns = format!("{NAMESERVER}:53");
        assert_eq!(
            first["reply"]["reply_from"],
            ns.as_str(),
            "{}: {v}",
            held.pod
        );
        assert_eq!(
            second["reply"]["reply_from"],
            ns.as_str(),
            "{}: {v}",
            held.pod
        );
        assert_eq!(second["reply"]["server"], "dns", "{}: {v}", held.pod);
    } else {
        // The app's getpeername and the proxy's SO_ORIGINAL_DST, asked again after two swaps.
        for seen in [first, second] {
            assert_eq!(seen["peer"], "10.0.0.5:80", "{}: {v}", held.pod);
            assert_eq!(seen["reply"]["server"], "outbound", "{}: {v}", held.pod);
            assert_eq!(seen["reply"]["orig"], "10.0.0.5:80", "{}: {v}", held.pod);
        }
    }
}

/// Sets its flag when dropped: the traffic threads stop also when an assertion fails, rather
/// than keeping the scope (and the test) alive forever.
struct StopOnDrop<'a>(&'a AtomicBool);

impl Drop for StopOnDrop<'_> {
    fn drop(&mut self) {
        self.0.store(true, Ordering::Release);
    }
}

/// Stops `agent` as a rolling update does, and starts the agent of `bin` in its place.
fn replace_agent(node: &Node, agent: &mut Agent, bin: &Path) -> Agent {
    agent.stop();
    let next = node.spawn_agent_of(bin, "ebpf", &[]);
    next.wait_ready();
    next
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one upgrade and rollback under traffic, its steps in the order they happen"
)]
fn a_node_upgrades_and_rolls_back_under_traffic_without_losing_a_connection() {
    let (old_bin, new_bin) = (capture_bin(), variant_capture_bin());
    let node = Node::new();
    let mut pods: Vec<Topology> = (1..=PODS)
        .map(|i| Topology::numbered(node.dirs.shared(), i))
        .collect();
    for (i, topo) in (1..=PODS).zip(pods.iter_mut()) {
        let mode = if on_iptables(i) { "iptables" } else { "ebpf" };
        topo.attach(&[
            "--mode",
            mode,
            "--redirect-dns",
            "--dns-nameserver",
            NAMESERVER,
        ]);
        topo.start_all();
        topo.start_dns_proxy();
    }
    let old_build = pods[0].status_by(&old_bin)["build"]
        .as_str()
        .expect("build")
        .to_string();
    let new_build = pods[0].status_by(&new_bin)["build"]
        .as_str()
        .expect("build")
        .to_string();
    assert_ne!(old_build, new_build, "the variant is another build");
    // The old build's pins, as its agent or its CLI leaves them (its agent's start would only
    // adopt them; the kernel matrix spares it).
    assert_node_on(&old_bin, &pods, &old_build, "before the upgrade");
    let old_programs = pinned_ids("prog", &node_pin_dir(&node.dirs.bpffs).join("programs"));
    let links = link_ids(&node.dirs.bpffs);

    let held = hold_connections(&pods);

    let phase = AtomicUsize::new(0);
    let per_phase: [AtomicUsize; 3] = Default::default();
    let failures = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let mut agent = std::thread::scope(|s| {
        for lane in 0..2 {
            let (pods, phase, per_phase, failures, stop) =
                (&pods, &phase, &per_phase, &failures, &stop);
            s.spawn(move || {
                for topo in pods.iter().skip(lane).step_by(2).cycle() {
                    if stop.load(Ordering::Acquire) {
                        break;
                    }
                    let now = phase.load(Ordering::Acquire);
                    match exchange(topo) {
                        Ok(()) => {
                            per_phase[now].fetch_add(1, Ordering::Relaxed);
                        }
                        Err(e) => failures.lock().unwrap().push(format!("phase {now}: {e}")),
                    }
                }
            });
        }
        let _stop_traffic = StopOnDrop(&stop);
        let settle = || std::thread::sleep(Duration::from_secs(2));
        settle();

        // Upgrade: the variant takes over in place.
        let mut agent = node.spawn_agent_of(&new_bin, "ebpf", &[]);
        agent.wait_ready();
        phase.store(1, Ordering::Release);
        assert_node_on(&new_bin, &pods, &new_build, "after the upgrade");
        let metrics = agent.checked_metrics();
        for series in [
            format!("capture_agent_build{{build=\"{new_build}\"}} 1"),
            format!("capture_node_program_build{{build=\"{new_build}\"}} 1"),
        ] {
            assert!(metrics.contains(&series), "{series} in\n{metrics}");
        }
        assert!(
            metrics.contains(&format!("build=\"{new_build}\"}} 1"))
                && metrics.contains("capture_pod_program_build{"),
            "{metrics}"
        );
        let new_programs = pinned_ids("prog", &node_pin_dir(&node.dirs.bpffs).join("programs"));
        let new_maps = pinned_ids("map", &node_pin_dir(&node.dirs.bpffs).join("maps"));
        assert_eq!(
            still_loaded("prog", &old_programs),
            Vec::<u64>::new(),
            "the old build's programs are gone once no link runs them"
        );
        assert_eq!(
            link_ids(&node.dirs.bpffs),
            links,
            "the links are updated in place"
        );
        settle();

        // Rollback: the first build takes the node back.
        agent = replace_agent(&node, &mut agent, &old_bin);
        phase.store(2, Ordering::Release);
        assert_node_on(&old_bin, &pods, &old_build, "after the rollback");
        assert_eq!(
            link_ids(&node.dirs.bpffs),
            links,
            "the links are updated in place"
        );
        assert_eq!(still_loaded("prog", &new_programs), Vec::<u64>::new());
        let kept = pinned_ids("map", &node_pin_dir(&node.dirs.bpffs).join("maps"));
        let left: Vec<u64> = still_loaded("map", &new_maps)
            .into_iter()
            .filter(|id| !kept.contains(id))
            .collect();
        assert_eq!(
            left,
            Vec::<u64>::new(),
            "maps only the variant used are gone"
        );
        settle();
        agent
    });

    let failures = failures.into_inner().unwrap();
    assert!(
        failures.is_empty(),
        "{} failed exchanges:\n{}",
        failures.len(),
        failures.join("\n")
    );
    let counts: Vec<usize> = per_phase
        .iter()
        .map(|n| n.load(Ordering::Relaxed))
        .collect();
    eprintln!("exchanges per phase (old, upgraded, rolled back): {counts:?}");
    for (i, n) in per_phase.iter().enumerate() {
        assert!(n.load(Ordering::Relaxed) > 0, "no traffic in phase {i}");
    }
    for h in held {
        check_held(h);
    }

    // Everything goes with the pods: no program, map or link of either build is left.
    let programs = pinned_ids("prog", &node_pin_dir(&node.dirs.bpffs).join("programs"));
    let maps = pinned_ids("map", &node_pin_dir(&node.dirs.bpffs).join("maps"));
    agent.stop();
    for topo in &pods {
        let out = topo.detach();
        assert!(out.status.success(), "{out:?}");
    }
    assert_eq!(still_loaded("link", &links), Vec::<u64>::new());
    std::fs::remove_dir_all(&node.dirs.bpffs).expect("removing the node's pins");
    assert_eq!(still_loaded("prog", &programs), Vec::<u64>::new());
    assert_eq!(still_loaded("map", &maps), Vec::<u64>::new());
}

/// Pins a build cannot understand: the node record says the socket-state map, which holds the
/// state of open connections, has a layout newer than any this build knows (as a newer build
/// would leave it). The agent says so and stays up, not ready; the running programs stay in
/// force; and once the pins are ones it knows, it takes the node over.
#[test]
fn a_build_that_meets_a_newer_layout_leaves_the_programs_in_force_and_says_why() {
    let new_bin = variant_capture_bin();
    let node = Node::new();
    let mut topo = Topology::numbered(node.dirs.shared(), 1);
    topo.attach(&[]);
    topo.start_all();
    let mut late = Topology::numbered(node.dirs.shared(), 2);
    late.start_all();
    exchange(&topo).expect("captured before");

    let record_path = node.dirs.state.join("node.json");
    let original = std::fs::read_to_string(&record_path).expect("node record");
    let mut record: Value = serde_json::from_str(&original).expect("node record JSON");
    record["layouts"]["SOCKET_STATES"] = 9.into();
    std::fs::write(&record_path, record.to_string()).expect("writing the node record");

    let mut agent = node.spawn_agent_of(&new_bin, "ebpf", &[]);
    let deadline = std::time::Instant::now() + READY_PATIENCE;
    let (code, body) = loop {
        let (code, body) = agent.wait_answer("/readyz");
        if body.contains("SOCKET_STATES") || std::time::Instant::now() > deadline {
            break (code, body);
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(code, 503, "{body}");
    for expected in ["layout version 9", "stay in force"] {
        assert!(body.contains(expected), "/readyz says {expected:?}: {body}");
    }
    exchange(&topo).expect("the running programs stay in force");

    // Another build's CLI does not attach a pod on top of programs it did not load.
    let out = capture_of(&new_bin, &topo)
        .args(["attach", "--netns"])
        .arg(late.pod.netns.path())
        .arg("--cgroup")
        .arg(&late.pod.cgroup.path)
        .args(["--pod-ip", &late.ip4])
        .output()
        .expect("capture attach");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    assert!(
        stderr.contains("this node's programs are capture build")
            && stderr.contains("takes the node over"),
        "{stderr}"
    );
    exchange(&topo).expect("still captured");
    let doctor = capture_of(&new_bin, &topo)
        .arg("doctor")
        .output()
        .expect("capture doctor");
    let said = String::from_utf8_lossy(&doctor.stdout);
    assert!(
        said.contains("would NOT take the node over") && said.contains("SOCKET_STATES"),
        "{said}"
    );

    // With pins it understands, the same build takes over.
    agent.stop();
    std::fs::write(&record_path, original).expect("restoring the node record");
    let agent = node.spawn_agent_of(&new_bin, "ebpf", &[]);
    agent.wait_ready();
    exchange(&topo).expect("captured after the takeover");
    let status = topo.status_by(&new_bin);
    assert_eq!(status["node_build"], status["build"], "{status}");
    assert_eq!(
        status["pods"][0]["program_build"], status["build"],
        "{status}"
    );
}

/// The previous release (built from the git history) pinned its programs at the top of the
/// bpffs directory and named no layouts. This build takes such a node over in place. Rolled back
/// to, that release cannot take the node back (it predates takeovers): it loads programs of its
/// own for new pods, and the running pods keep this build's, captured. Upgraded again, this
/// build moves them onto its programs with the state of their open connections, which lives in
/// the maps the pods ran with, not in the ones the old release pinned last.
#[test]
fn a_node_of_the_previous_release_upgrades_in_place_and_survives_a_rollback_to_it() {
    let (previous, current) = (previous_release_capture_bin(), capture_bin());
    let node = Node::new();
    let mut pods: Vec<Topology> = (1..=4)
        .map(|i| Topology::numbered(node.dirs.shared(), i))
        .collect();
    for (i, topo) in (1..=4).zip(pods.iter_mut()) {
        let mode = if on_iptables(i) { "iptables" } else { "ebpf" };
        let out = capture_of(&previous, topo)
            .args(["attach", "--netns"])
            .arg(topo.pod.netns.path())
            .arg("--cgroup")
            .arg(&topo.pod.cgroup.path)
            .args(["--pod-ip", &topo.ip4, "--pod-ip", &topo.ip6, "--mode", mode])
            .args(["--redirect-dns", "--dns-nameserver", NAMESERVER])
            .output()
            .expect("capture attach (previous release)");
        assert!(out.status.success(), "{out:?}");
        topo.start_all();
        topo.start_dns_proxy();
    }
    let legacy_programs = pinned_ids("prog", &node.dirs.bpffs.join("programs"));
    let links = link_ids(&node.dirs.bpffs);
    let held = hold_connections(&pods);
    let build = pods[0].status_by(&current)["build"]
        .as_str()
        .expect("build")
        .to_string();
    let all_exchange = |phase: &str| {
        for topo in &pods {
            if let Err(e) = exchange(topo) {
                panic!("{phase}: {e}");
            }
        }
    };
    all_exchange("on the previous release");

    let mut agent = node.spawn_agent_of(&current, "ebpf", &[]);
    agent.wait_ready();
    all_exchange("upgraded");
    assert_node_on(&current, &pods, &build, "upgraded");
    assert!(
        !node.dirs.bpffs.join("programs").exists() && !node.dirs.bpffs.join("maps").exists(),
        "the previous release's pins are gone"
    );
    assert_eq!(still_loaded("prog", &legacy_programs), Vec::<u64>::new());
    // Every link is updated in place; the hooks the previous release lacks are linked anew,
    // once per ebpf pod.
    let upgraded = link_ids(&node.dirs.bpffs);
    assert!(
        links.iter().all(|l| upgraded.contains(l)),
        "the links are updated in place: {links:?} then {upgraded:?}"
    );
    let ebpf_pods = (1..=4).filter(|i| !on_iptables(*i)).count();
    let new_hooks = ["capture_getsockname4", "capture_getsockname6"];
    for hook in new_hooks {
        let linked = pod_link_names(&node.dirs.bpffs)
            .iter()
            .filter(|n| *n == hook)
            .count();
        assert_eq!(linked, ebpf_pods, "{hook}");
    }
    assert_eq!(upgraded.len(), links.len() + new_hooks.len() * ebpf_pods);

    agent = replace_agent(&node, &mut agent, &previous);
    all_exchange("rolled back to the previous release");

    agent = replace_agent(&node, &mut agent, &current);
    all_exchange("upgraded again");
    assert_node_on(&current, &pods, &build, "upgraded again");
    assert_eq!(
        link_ids(&node.dirs.bpffs),
        upgraded,
        "the links are updated in place"
    );
    for h in held {
        check_held(h);
    }
    agent.stop();
    for topo in &pods {
        let out = topo.detach();
        assert!(out.status.success(), "{out:?}");
        // The previous release wrote other rules for the same settings (DNS chains in a family
        // without a nameserver): detach removes what the netns holds, not only what this build
        // would have written.
        for save in ["iptables-save", "ip6tables-save"] {
            let left = saved_rules_with(&topo.pod.netns.path(), save, &[]);
            assert!(!left.contains("ISTIO"), "{save} after detach:\n{left}");
        }
    }
    assert_eq!(still_loaded("link", &links), Vec::<u64>::new());
}
