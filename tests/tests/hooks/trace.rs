//! `capture trace` on real traffic: each decision of the traced pod, with the rule `capture
//! explain` gives for the same connection; nothing of other pods; a rate limit that counts what
//! it drops; a session that ends, or is killed, leaves no pod traced.

use std::{
    io::Read as _,
    process::{Child, Command, Stdio},
    time::Duration,
};

use capture_tests::{
    cases::{default_sidecar_cases, Case},
    explain::explain_case,
    probe::Who,
    topology::Topology,
    wait::wait_for,
};
use serde_json::Value;

/// A running `capture trace --json` of `topo`'s pod, with its output collected at the end.
struct Session(Child);

impl Session {
    fn start(topo: &Topology, extra: &[&str]) -> Self {
        let netns = topo.pod.netns.path();
        let mut args = vec!["trace", "--json", "--netns", netns.to_str().unwrap()];
        args.extend(extra);
        let child = topo
            .capture_command(&args)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .expect("capture trace");
        let pid = u64::from(child.id());
        wait_for(Duration::from_secs(10), "the session's trace lease", || {
            topo.status()["trace"]["sessions"]
                .as_array()
                .is_some_and(|s| s.iter().any(|s| s["pid"] == pid))
        });
        Self(child)
    }

    /// Ends the session (SIGINT, as Ctrl-C) and returns its events and its closing summary.
    fn stop(mut self) -> (Vec<Value>, Value) {
        let pid = nix::unistd::Pid::from_raw(self.0.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGINT);
        let status = self.0.wait().expect("trace ends");
        let (mut out, mut err) = (String::new(), String::new());
        self.0
            .stdout
            .take()
            .unwrap()
            .read_to_string(&mut out)
            .unwrap();
        self.0
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut err)
            .unwrap();
        assert!(status.success(), "trace failed: {err}");
        let events = out
            .lines()
            .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("{l}: {e}")))
            .collect();
        let summary = err
            .lines()
            .rev()
            .find_map(|l| serde_json::from_str(l).ok())
            .unwrap_or_else(|| panic!("no summary in {err}"));
        (events, summary)
    }
}

fn traced_pods(topo: &Topology) -> u64 {
    topo.status()["trace"]["traced_pods"].as_u64().unwrap_or(0)
}

fn explain_rule(topo: &Topology, case: &Case, direction: &str) -> String {
    explain_case(topo, case, direction)["rule"]
        .as_str()
        .expect("a rule")
        .to_string()
}

/// The events of a connection to `to` by `who` (any for inbound, which has no owner).
fn events_of<'e>(events: &'e [Value], to: &str, who: Option<&Who>) -> Vec<&'e Value> {
    events
        .iter()
        .filter(|e| e["dst"] == to)
        .filter(|e| who.is_none_or(|w| e["uid"] == w.uid && e["gid"] == w.gid))
        .collect()
}

#[test]
fn each_decision_is_traced_with_the_rule_explain_gives() {
    let mut topo = Topology::new();
    topo.attach(&["--mode", "ebpf"]);
    topo.start_all();
    let cases: Vec<Case> = default_sidecar_cases()
        .into_iter()
        .filter(|c| {
            !c.from_remote
                && c.opts.create_as.is_none()
                && !c.opts.v6_socket
                && c.who.effective.is_none()
                && c.who.groups.is_empty()
        })
        .collect();
    let session = Session::start(&topo, &[]);
    for case in &cases {
        topo.connect(&case.who, case.to, &case.opts);
    }
    topo.connect_from_remote("10.1.0.10:8080");
    let (events, summary) = session.stop();
    let mut wrong = Vec::new();
    for case in &cases {
        let want = explain_rule(&topo, case, "outbound");
        let seen = events_of(&events, case.to, Some(&case.who));
        if !seen.iter().any(|e| e["rule"] == want.as_str()) {
            wrong.push(format!(
                "{} ({} to {}): explain says {want}, trace saw {seen:?}",
                case.id, case.who.uid, case.to
            ));
        }
    }
    let inbound = Case::new(
        "inbound",
        Who::app(),
        "10.1.0.10:8080",
        capture_tests::cases::Expect::App,
    );
    let want = explain_rule(&topo, &inbound, "inbound");
    let seen = events_of(&events, "10.1.0.10:8080", None);
    assert!(
        seen.iter().any(|e| e["hook"] == "sk_lookup"
            && e["rule"] == want.as_str()
            && e["verdict"] == "redirect"
            && e["port"] == 15006),
        "inbound: explain says {want}, trace saw {seen:?}"
    );
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
    // The process and owner of an outbound decision are the connecting probe's.
    let first = events
        .iter()
        .find(|e| e["hook"] == "connect4")
        .expect("a connect4 event");
    assert!(
        first["pid"].as_u64().is_some_and(|p| p > 0) && first["comm"].is_string(),
        "{first}"
    );
    assert_eq!(summary["dropped"], 0, "{summary}");
    assert_eq!(traced_pods(&topo), 0, "the session's end ends the lease");
}

#[test]
fn a_trace_is_the_pods_own_bounded_and_ends_with_its_session() {
    let mut a = Topology::new();
    let mut b = Topology::numbered(a.dirs.shared(), 1);
    for topo in [&mut a, &mut b] {
        topo.attach(&["--mode", "ebpf"]);
        topo.start_proxy();
    }
    let app = Who::app();
    let session = Session::start(&a, &["--rate", "2"]);
    // A second session on the same pod is refused while the first lives.
    let netns = a.pod.netns.path();
    let out = a.capture(&[
        "trace",
        "--netns",
        netns.to_str().unwrap(),
        "--duration",
        "1",
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("traced already"),
        "{stderr}"
    );
    for _ in 0..3 {
        b.tcp(&app, "10.0.0.7:80");
    }
    // Connections through one probe process, faster than two a second even under emulation,
    // until the lease counts a drop.
    let probes = capture_tests::probe::Sessions::default();
    let started = std::time::Instant::now();
    let dropped = |a: &Topology| {
        a.status()["trace"]["sessions"][0]["dropped"]
            .as_u64()
            .unwrap_or(0)
    };
    let mut made = 0;
    while made < 200 {
        for _ in 0..10 {
            probes.connect(
                a.probe_in_pod(&app),
                "10.0.0.5:80",
                &capture_tests::probe::ConnectOpts::default(),
            );
        }
        made += 10;
        if dropped(&a) > 0 {
            break;
        }
    }
    // Two per started second at the most (the windows the connections fell into).
    let most = 2 * (started.elapsed().as_secs() as usize + 2);
    drop(probes);
    let (events, summary) = session.stop();
    assert!(
        events_of(&events, "10.0.0.7:80", None).is_empty(),
        "another pod's connections: {events:?}"
    );
    let shown = events_of(&events, "10.0.0.5:80", Some(&app)).len();
    assert!(
        (2..=most).contains(&shown) && shown < made,
        "{shown} events of {made} connections at --rate 2, {most} at the most"
    );
    assert!(
        summary["dropped"].as_u64().unwrap_or(0) > 0,
        "the rate limit counts what it drops: {summary}"
    );
    let metrics = a.status()["trace"].clone();
    assert!(
        metrics["dropped"].as_u64().unwrap_or(0) > 0 && metrics["traced_pods"] == 0,
        "{metrics}"
    );

    // A session killed outright leaves its lease, which stops being renewed: the next session
    // waits it out (5 s at the most) and takes the pod over.
    let mut killed = Session::start(&a, &[]);
    killed.0.kill().unwrap();
    killed.0.wait().unwrap();
    assert_eq!(
        traced_pods(&a),
        1,
        "a killed session's lease stays until someone clears it"
    );
    let next = Session::start(&a, &[]);
    a.tcp(&app, "10.0.0.5:81");
    let (events, _) = next.stop();
    assert_eq!(
        events_of(&events, "10.0.0.5:81", Some(&app)).len(),
        1,
        "{events:?}"
    );
    assert_eq!(traced_pods(&a), 0);
}

#[test]
fn an_iptables_pod_or_an_unknown_pod_is_a_clear_error() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path();
    let netns = netns.to_str().unwrap();
    topo.attach(&["--mode", "iptables"]);
    // The node has no programs (an iptables pod alone): the pod's backend is said first.
    let out = topo.capture(&["trace", "--netns", netns, "--duration", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && stderr.contains("iptables backend")
            && stderr.contains("capture explain"),
        "{stderr}"
    );
    let out = topo.capture(&["trace", "--pod", "default/nobody", "--duration", "1"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no captured pod matches pod default/nobody"),
        "{stderr}"
    );
    let mut cmd = Command::new(capture_tests::topology::capture_bin());
    let out = cmd
        .args(["trace", "--netns", netns, "--filter", "colour=red"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("colour"),
        "{stderr}"
    );
}

#[test]
fn exclusions_dns_and_refusals_are_traced_with_their_rules() {
    let mut topo = Topology::new();
    topo.attach(&[
        "--mode",
        "ebpf",
        "--annotation",
        "traffic.sidecar.istio.io/excludeOutboundPorts=9000",
        "--annotation",
        "traffic.sidecar.istio.io/excludeOutboundIPRanges=10.2.0.0/16",
        "--annotation",
        "traffic.sidecar.istio.io/excludeInboundPorts=9100",
        "--redirect-dns",
        "--dns-nameserver",
        "10.0.0.53",
    ]);
    // No proxy listens for inbound: a captured inbound connection is refused.
    topo.start_dns_proxy();
    let app = Who::app();
    let udp = capture_tests::probe::ConnectOpts {
        udp: true,
        ..capture_tests::probe::ConnectOpts::default()
    };
    let session = Session::start(&topo, &[]);
    topo.tcp(&app, "10.0.0.5:9000");
    topo.tcp(&app, "10.2.0.5:80");
    topo.connect(&app, "10.0.0.53:53", &udp);
    topo.tcp(&Who::proxy(), "10.0.0.5:80");
    topo.connect_from_remote("10.1.0.10:8080");
    topo.connect_from_remote("10.1.0.10:9100");
    let (events, _) = session.stop();
    for (to, who, rule, verdict) in [
        ("10.0.0.5:9000", Some(&app), "exclude-outbound-port", "pass"),
        ("10.2.0.5:80", Some(&app), "exclude-outbound-cidr", "pass"),
        ("10.0.0.53:53", Some(&app), "dns", "redirect"),
        ("10.0.0.5:80", Some(&Who::proxy()), "proxy-uid", "pass"),
        ("10.1.0.10:8080", None, "include-all-inbound", "refuse"),
        ("10.1.0.10:9100", None, "exclude-inbound-port", "pass"),
    ] {
        let seen = events_of(&events, to, who);
        assert!(
            seen.iter()
                .any(|e| e["rule"] == rule && e["verdict"] == verdict),
            "{to}: want {rule} {verdict}, saw {seen:?}"
        );
    }
    let dns = events_of(&events, "10.0.0.53:53", Some(&app));
    assert!(
        dns.iter()
            .any(|e| e["proto"] == "udp" && e["port"] == 15053),
        "{dns:?}"
    );
}
