//! `capture explain` against what the kernel does: the parity matrix's default cases asked of
//! explain, then made on real traffic, under both backends. The traffic is checked against the
//! cases' expectations (`run_cases_on`), and explain's answer against the same expectations, so
//! the two agree; for an iptables pod, the rule explain names must count the connection.

use capture_tests::{
    cases::{default_sidecar_cases, run_cases_on, Backend, Case, Expect},
    explain::explain_case,
    topology::Topology,
};
use serde_json::Value;

fn explain(topo: &Topology, case: &Case) -> Value {
    explain_case(topo, case, "outbound")
}

/// The cases explain can be asked: a socket created and connected by one identity, from the pod.
fn askable(case: &Case) -> bool {
    !case.from_remote
        && case.opts.create_as.is_none()
        && !case.opts.v6_socket
        && !case.opts.transparent
        && case.opts.mark.is_none()
        && case.who.effective.is_none()
        && case.who.groups.is_empty()
}

/// What explain must answer for the case's expectation: the verdict and, for a redirect, the port.
fn agrees(case: &Case, answer: &Value) -> Result<(), String> {
    let verdict = answer["verdict"].as_str().unwrap_or_default();
    let port = answer["port"].as_u64().unwrap_or_default();
    let ok = match case.expect {
        Expect::Outbound(_) => verdict == "redirect" && port == 15001,
        Expect::Inbound(_) => verdict == "redirect" && port == 15006,
        Expect::Dns(_) => verdict == "redirect" && port == 15053,
        Expect::Remote(_) | Expect::App => verdict == "pass",
        // Refused where it went (a pass to nothing) or refused at the proxy's port.
        Expect::Refused(_) => verdict == "pass" || verdict == "refuse",
        Expect::Captured(_) => true,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "{} ({} to {}): explain says {verdict} {port} by {}, the case expects {:?}",
            case.id, case.who.uid, case.to, answer["rule"], case.expect
        ))
    }
}

fn packets(answer: &Value) -> Option<u64> {
    answer["iptables_rule"]["packets"].as_u64()
}

#[test]
fn explain_agrees_with_the_traffic_under_both_backends() {
    let cases: Vec<Case> = default_sidecar_cases()
        .into_iter()
        .filter(askable)
        .collect();
    assert!(cases.len() >= 10, "a real sample: {} cases", cases.len());
    for backend in Backend::ALL {
        let mut topo = Topology::new();
        topo.attach(&["--mode", backend.mode()]);
        topo.start_all();
        let mut wrong = Vec::new();
        let mut counted = 0;
        for case in &cases {
            let before = explain(&topo, case);
            assert_eq!(before["backend"], backend.mode(), "{before}");
            assert!(
                before["rule"].as_str().is_some_and(|r| !r.is_empty())
                    && before["iptables_equivalent"].is_string(),
                "{before}"
            );
            if let Err(e) = agrees(case, &before) {
                wrong.push(e);
            }
            if backend != Backend::Iptables {
                continue;
            }
            let names_a_rule = before["iptables_equivalent"]
                .as_str()
                .is_some_and(|r| r.starts_with("-A "));
            let Some(first) = packets(&before) else {
                if names_a_rule {
                    wrong.push(format!(
                        "{}: the rule explain names is not in the pod: {before}",
                        case.id
                    ));
                }
                continue;
            };
            topo.connect(&case.who, case.to, &case.opts);
            let then = packets(&explain(&topo, case)).unwrap_or_default();
            if then <= first {
                wrong.push(format!(
                    "{}: the rule explain names did not count the connection ({first} then {then}): {}",
                    case.id, before["iptables_rule"]["line"]
                ));
            }
            counted += 1;
        }
        assert!(wrong.is_empty(), "{backend:?}:\n{}", wrong.join("\n"));
        if backend == Backend::Iptables {
            assert!(counted >= 8, "only {counted} cases named a live rule");
        }
        // The traffic does what the cases expect, so what explain said is what happened.
        run_cases_on(&topo, Some(backend), &cases);
    }
}

#[test]
fn an_unknown_pod_or_a_malformed_question_is_a_clear_error() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path();
    let netns = netns.to_str().unwrap();
    let out = topo.capture(&["explain", "--netns", netns, "--to", "10.0.0.5:80"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("no captured pod matches"),
        "{stderr}"
    );
    topo.attach(&["--mode", "ebpf"]);
    for (args, words) in [
        (vec!["--to", "10.0.0.5"], "--to"),
        (vec!["--to", "10.0.0.5:80", "--proto", "sctp"], "--proto"),
        (
            vec!["--to", "10.0.0.5:80", "--pod", "no-slash"],
            "NAMESPACE/NAME",
        ),
    ] {
        let mut all = vec!["explain"];
        if !args.contains(&"--pod") {
            all.extend(["--netns", netns]);
        }
        all.extend(args);
        let out = topo.capture(&all);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success() && stderr.contains(words),
            "{all:?}: {stderr}"
        );
    }
    let out = topo.capture(&["explain", "--pod", "default/nobody", "--to", "10.0.0.5:80"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("no captured pod matches pod default/nobody"),
        "{stderr}"
    );
    // The text form names the verdict, the rule and Istio's rule; IPv6 is asked like IPv4.
    let out = topo.capture(&["explain", "--netns", netns, "--to", "[fd00:2::5]:443"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for words in [
        "verdict:",
        "rule:     include-all-outbound",
        "-A ISTIO_OUTPUT -j ISTIO_REDIRECT",
    ] {
        assert!(stdout.contains(words), "{words} in\n{stdout}");
    }
}
