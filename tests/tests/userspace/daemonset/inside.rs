//! What the DaemonSet's agent is, seen from its own container as `kubectl exec` sees it: the
//! context the runtime gave its process, and the commands an operator runs there.

use capture_tests::{
    containerd::{cri::Cri, node_agent::NodeAgentRun, Containerd, CriPod},
    daemonset,
};

/// The agent's process runs as the manifest asks, as the runtime applied it: with exactly the
/// capabilities it adds, no way to gain more, the runtime's default seccomp filter, and a PID
/// namespace of its own.
pub(super) fn assert_runs_restricted(
    runtime: &Containerd,
    pod: &daemonset::NodeAgentPod,
    cid: &str,
) {
    // Bit numbers from linux/capability.h.
    const BITS: [(&str, u32); 9] = [
        ("CHOWN", 0),
        ("DAC_OVERRIDE", 1),
        ("FOWNER", 3),
        ("NET_ADMIN", 12),
        ("NET_RAW", 13),
        ("SYS_PTRACE", 19),
        ("SYS_ADMIN", 21),
        ("PERFMON", 38),
        ("BPF", 39),
    ];
    let pid = runtime
        .cri()
        .container_pid(cid)
        .expect("ContainerStatus")
        .expect("the agent runs");
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("its status");
    let field = |name: &str| {
        status
            .lines()
            .find_map(|l| Some(l.strip_prefix(name)?.strip_prefix(':')?.trim()))
            .unwrap_or_else(|| panic!("no {name} in {status}"))
    };
    let wanted: u64 = pod.containers[0]
        .capabilities_add
        .iter()
        .map(|name| {
            let bit = BITS.iter().find(|(n, _)| n == name).map(|(_, b)| *b);
            1 << bit.unwrap_or_else(|| panic!("{name}: not a capability the test knows"))
        })
        .sum();
    let effective = u64::from_str_radix(field("CapEff"), 16).expect("hex");
    assert_eq!(effective, wanted, "CapEff {effective:x}, wanted {wanted:x}");
    assert_eq!(
        field("CapBnd"),
        field("CapEff"),
        "no capability beyond them"
    );
    assert_eq!(field("NoNewPrivs"), "1");
    // 2: a seccomp filter (containerd's default profile) is in force.
    assert_eq!(
        field("Seccomp"),
        "2",
        "the runtime's default seccomp profile"
    );
    let ns = |p: String| std::fs::read_link(p).expect("a pid namespace");
    assert_ne!(
        ns(format!("/proc/{pid}/ns/pid")),
        ns("/proc/self/ns/pid".into()),
        "the agent has no hostPID"
    );
}

/// `capture sockets` run in the agent's container (as `kubectl exec` runs it, with the
/// container's environment): the meshed pod's listeners with their holders as the node numbers
/// them, found through the node's /proc, and a note that says why their app view is missing.
pub(super) fn sockets_seen_from_the_agents_container(runtime: &Containerd, cid: &str) {
    let out = runtime
        .cri()
        .exec(
            cid,
            &[
                "/usr/local/bin/capture",
                "sockets",
                "--pod",
                "default/meshed",
                "--json",
            ],
        )
        .expect("ExecSync");
    let text = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.exit_code,
        0,
        "{text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let holders: Vec<&serde_json::Value> = report["listeners"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|l| l["holder"].as_object().map(|_| &l["holder"]))
        .collect();
    assert!(!holders.is_empty(), "listeners with holders: {report}");
    for holder in holders {
        let comm = std::fs::read_to_string(format!("/proc/{}/comm", holder["pid"]))
            .expect("the holder, by the node's pid");
        assert_eq!(holder["command"], comm.trim_end(), "{report}");
    }
    assert!(
        report["notes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n.as_str().is_some_and(|n| n.contains("PID namespace"))),
        "a note on the app view: {report}"
    );
}

/// `capture trace` run in the agent's container while the meshed pod's app connects: the
/// decision is streamed there (the trace's lease and ring buffer are the node's pinned maps).
pub(super) fn traced_from_the_agents_container(
    runtime: &Containerd,
    cid: &str,
    meshed: &CriPod,
    ip: &str,
) {
    let cid_of_tracer = cid.to_string();
    let (socket, cid) = (runtime.socket().to_path_buf(), cid.to_string());
    // A client of its own: the runtime's is busy with the connection meanwhile.
    let tracer = std::thread::spawn(move || {
        let mut cri = Cri::connect(&socket).expect("a second CRI client");
        let argv = [
            "/usr/local/bin/capture",
            "trace",
            "--pod",
            "default/meshed",
            "--json",
            "--duration",
            "4",
        ];
        cri.exec(&cid, &argv).expect("ExecSync")
    });
    // Connections until the trace ends: its start (an exec, then the lease) takes its time.
    let to = format!("{ip}:9090");
    while !tracer.is_finished() {
        runtime
            .connect_from(meshed, "app", &to)
            .assert_served_by("outbound", "while traced");
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    let out = tracer.join().expect("the tracer");
    let text = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // A pod `--mode auto` gave a rule backend has no kernel decisions to stream: trace says so
    // and names netfilter's tracing instead. Seen once in a full CI run, most likely where
    // another test's restricted agent swept this agent's probe cgroup as a dead process's (its
    // PID read in the wrong PID namespace, fixed since: capabilities.rs tests the sweep). Such a
    // pod must be a fallback the node explains, never a silent one.
    if stderr.contains("backend, whose decisions are netfilter's") {
        assert_ne!(out.exit_code, 0, "{stderr}");
        let status = exec_json(runtime, &cid_of_tracer, &["status", "--all", "--json"]);
        let pod = status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .find(|p| p["pod"]["name"] == "meshed")
            .unwrap_or_else(|| panic!("the meshed pod in capture status --all: {status}"));
        assert!(
            pod["fallback_cause"].is_string() && pod["fallback_reason"].is_string(),
            "a meshed pod on a rule backend under --mode auto says why: {pod}"
        );
        return;
    }
    assert!(
        text.lines().any(|line| line.contains(&to)),
        "the traced decision for {to}: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The id of the DaemonSet pod's container `name`.
pub(super) fn container_of(agent: &NodeAgentRun, name: &str) -> String {
    let (_, id) = agent
        .containers
        .iter()
        .find(|(n, _)| n == name)
        .unwrap_or_else(|| panic!("no container {name}"));
    id.clone()
}

/// `capture ARGS` run in the agent's container (`kubectl exec`'s position), its JSON answer.
pub(super) fn exec_json(runtime: &Containerd, cid: &str, args: &[&str]) -> serde_json::Value {
    exec_json_of(runtime, cid, "/usr/local/bin/capture", args)
}

/// As `exec_json`, with the `capture` binary at `bin` in the container.
pub(super) fn exec_json_of(
    runtime: &Containerd,
    cid: &str,
    bin: &str,
    args: &[&str],
) -> serde_json::Value {
    let argv: Vec<&str> = std::iter::once(bin).chain(args.iter().copied()).collect();
    let out = runtime.cri().exec(cid, &argv).expect("ExecSync");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    assert_eq!(
        out.exit_code,
        0,
        "capture {args:?} in the agent's container: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("capture {args:?}: {e}: {text}"))
}
