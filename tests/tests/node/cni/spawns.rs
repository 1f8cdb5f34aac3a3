//! What a CNI ADD runs besides capture: no program at all on the ebpf backend (every look into
//! the pod's netns, for Istio's rules and its tables, and the IPv6 inbound-passthrough address
//! are asked of the kernel from the agent's own process), and each rule backend its own tool
//! once per write. Counted with strace following the agent: every execve its threads and
//! children make while the runtime runs the chain.

use std::{
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use capture_tests::{
    cni::{CgroupDriver, Node, MESHED},
    topology::cgroup_programs,
    unique,
    wait::wait_for,
};

/// strace attached to a running process, following its threads and children, logging each
/// program they start.
struct ExecTrace {
    strace: Child,
    pid: u32,
    log: PathBuf,
}

impl ExecTrace {
    fn attach(pid: u32) -> Self {
        let log = std::env::temp_dir().join(unique("capture-exec-trace"));
        let strace = Command::new("strace")
            // -z: a program found on PATH is tried in each directory first; only the start counts.
            .args(["-f", "-qq", "-z", "-e", "trace=execve,execveat", "-e", "signal=none"])
            .arg("-o")
            .arg(&log)
            .args(["-p", &pid.to_string()])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("strace (cargo xtask setup installs it)");
        let trace = Self { strace, pid, log };
        // strace says nothing once it holds the process: each thread shows its tracer.
        wait_for(Duration::from_secs(10), "strace to hold the agent", || {
            trace.every_thread_traced()
        });
        trace
    }

    fn every_thread_traced(&self) -> bool {
        let Ok(tasks) = std::fs::read_dir(format!("/proc/{}/task", self.pid)) else {
            return false;
        };
        tasks.flatten().all(|task| {
            std::fs::read_to_string(task.path().join("status")).is_ok_and(|s| {
                s.lines().any(|l| {
                    l.starts_with("TracerPid:") && l.split_whitespace().nth(1) != Some("0")
                })
            })
        })
    }

    /// Detaches and returns the programs started since `attach`, by path.
    fn programs(mut self) -> Vec<String> {
        // SIGINT makes strace detach and flush its log.
        let _ = nix::sys::signal::kill(
            nix::unistd::Pid::from_raw(self.strace.id() as i32),
            nix::sys::signal::Signal::SIGINT,
        );
        let _ = self.strace.wait();
        let log = std::fs::read_to_string(&self.log).unwrap_or_default();
        log.lines()
            .filter(|l| l.contains("execve") && !l.contains("= -1"))
            .filter_map(|l| l.split('"').nth(1))
            .map(str::to_owned)
            .collect()
    }
}

impl Drop for ExecTrace {
    fn drop(&mut self) {
        let _ = self.strace.kill();
        let _ = self.strace.wait();
        let _ = std::fs::remove_file(&self.log);
    }
}

/// A dual-stack pod added through the chain with the agent in `mode`; the programs the agent
/// started meanwhile.
fn programs_of_one_add(mode: &str) -> Vec<String> {
    let node = Node::new();
    node.dual_stack();
    let agent = node.start_agent(mode);
    let mut pod = node.pod("spawns", CgroupDriver::Cgroupfs, MESHED);
    let trace = ExecTrace::attach(agent.pid());
    let added = node.add(&mut pod);
    let programs = trace.programs();
    let result = added.unwrap_or_else(|e| panic!("ADD in {mode} mode: {e}"));
    assert_eq!(
        result["ips"].as_array().map(Vec::len),
        Some(2),
        "a dual-stack pod: {result}"
    );
    if mode == "ebpf" {
        assert!(!cgroup_programs(&pod.cgroup).is_empty(), "not captured");
    }
    let _ = node.del(&pod);
    programs
}

fn names(programs: &[String]) -> Vec<&str> {
    programs
        .iter()
        .map(|p| p.rsplit('/').next().unwrap_or(p))
        .collect()
}

#[test]
fn an_ebpf_add_starts_no_program_and_a_rule_backend_one_per_write() {
    let ebpf = programs_of_one_add("ebpf");
    assert!(ebpf.is_empty(), "an ebpf ADD started {ebpf:?}");

    // One restore per family, in the node's variant.
    let iptables = programs_of_one_add("iptables");
    let ran = names(&iptables);
    assert_eq!(ran.len(), 2, "iptables ADD of a dual-stack pod ran {ran:?}");
    assert!(
        ran[0].starts_with("iptables") && ran[1].starts_with("ip6tables"),
        "{ran:?}"
    );
    assert!(ran.iter().all(|n| n.ends_with("-restore")), "{ran:?}");

    // One nft for both families (its inet tables).
    let nftables = programs_of_one_add("nftables");
    assert_eq!(names(&nftables), ["nft"], "nftables ADD ran {nftables:?}");
}
