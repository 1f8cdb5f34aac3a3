//! deploy/grafana-dashboard.json against a real agent and a real Prometheus: Grafana can import
//! it, and every query of every panel names only series the agent exports, reads them as their
//! type asks, follows the node variable, is accepted by Prometheus and shows data for a node with
//! an ebpf pod, a pod that fell back to iptables and a failed ADD.

use std::time::Instant;

use capture_tests::{
    cni::{CgroupDriver, Node, Pod, MESHED},
    dashboard::{self, check_target, label_values_of, Answer, Exposition, Problem, Target},
    prometheus::{free_loopback_addr, start_agent_with_metrics, Prometheus, SCRAPED},
    wait::wait_until,
};

/// Families a panel reads that the agent leaves out of its scrape until it has counted one, which
/// this scenario cannot make it count: (family, type, why). Each must be absent from the scrape;
/// once the scenario makes the agent export one, it leaves this list and is held to the scrape
/// as every other family is.
const NOT_IN_THIS_SCENARIO: &[(&str, &str, &str)] = &[(
    "capture_repairs_total",
    "counter",
    "only the reconcile with a container runtime repairs (userspace/reconcile.rs runs it with \
     containerd and reads this family), and a family without series is left out of the scrape",
)];

#[test]
fn grafana_can_import_the_dashboard() {
    let dashboard = dashboard::load();
    let problems = dashboard::import_problems(&dashboard);
    assert!(problems.is_empty(), "{}", problems.join("\n"));
    assert!(!dashboard::targets(&dashboard).is_empty());
}

/// The pods that give every panel something to show: one on ebpf, one that `--mode auto` puts
/// on iptables (TPROXY), and one whose ADD the agent refuses (a port that is no number).
fn capture_pods(node: &Node) -> Vec<Pod> {
    let mut ebpf = node.pod("ebpf", CgroupDriver::Cgroupfs, MESHED);
    let tproxy_annotations = [MESHED[0], ("sidecar.istio.io/interceptionMode", "TPROXY")];
    let mut tproxy = node.pod("tproxy", CgroupDriver::Systemd, &tproxy_annotations);
    let refused_annotations = [
        MESHED[0],
        ("traffic.sidecar.istio.io/excludeInboundPorts", "eighty"),
    ];
    let mut refused = node.pod("refused", CgroupDriver::Cgroupfs, &refused_annotations);
    node.add(&mut ebpf).expect("ADD ebpf");
    node.add(&mut tproxy).expect("ADD tproxy");
    node.add(&mut refused)
        .expect_err("ADD with excludeInboundPorts=eighty");
    vec![ebpf, tproxy]
}

/// Every target checked once; Err lists the targets without data yet. A broken query fails at
/// once, with every other problem seen.
fn check_all(
    prometheus: &Prometheus,
    exposition: &Exposition,
    targets: &[Target],
) -> Result<Vec<(Target, Answer)>, String> {
    let mut answers = Vec::new();
    let mut problems = Vec::new();
    for target in targets {
        match check_target(prometheus, exposition, target) {
            Ok(answer) => answers.push((target.clone(), answer)),
            Err(problem) => problems.push(problem),
        }
    }
    let (broken, empty): (Vec<_>, Vec<_>) = problems
        .iter()
        .partition(|p| matches!(p, Problem::Broken(_)));
    let said = |problems: &[&Problem]| {
        let lines: Vec<String> = problems.iter().map(ToString::to_string).collect();
        lines.join("\n")
    };
    assert!(
        broken.is_empty(),
        "{}\n({} other targets without data so far)",
        said(&broken),
        empty.len()
    );
    if empty.is_empty() {
        Ok(answers)
    } else {
        Err(said(&empty))
    }
}

/// A target without data passes only for the families of [`NOT_IN_THIS_SCENARIO`], and each of
/// those is read by some panel.
fn assert_silent_only_where_expected(answers: &[(Target, Answer)]) {
    let silent = |family: &str| {
        answers
            .iter()
            .any(|(_, a)| matches!(a, Answer::NotExported(f) if f.iter().any(|f| f == family)))
    };
    for (target, answer) in answers {
        if let Answer::NotExported(families) = answer {
            for family in families {
                assert!(
                    NOT_IN_THIS_SCENARIO.iter().any(|(f, _, _)| f == family),
                    "panel \"{}\" ({}) shows nothing: the agent has no sample of {family}",
                    target.panel,
                    target.ref_id
                );
            }
        }
    }
    for (family, _, _) in NOT_IN_THIS_SCENARIO {
        assert!(
            silent(family),
            "no panel reads {family}: take it off NOT_IN_THIS_SCENARIO"
        );
    }
}

#[test]
fn every_panel_reads_series_the_agent_exports_and_shows_data() {
    let started = Instant::now();
    let dashboard = dashboard::load();
    let targets = dashboard::targets(&dashboard);
    // Prometheus first: its first scrape of a new target takes seconds, which the agent's start
    // then spends.
    let metrics = free_loopback_addr();
    let prometheus = Prometheus::start(&[metrics]);
    let node = Node::new();
    // As deploy/capture.yaml runs it: auto mode, keeping capture-cni chained.
    node.install_cni();
    let conf_dir = node.conf_dir();
    let chain = [
        "--watch-cni-config",
        "--cni-conf-dir",
        conf_dir.to_str().unwrap(),
        "--cni-bin-dir",
        node.plugin_dir.to_str().unwrap(),
    ];
    let agent = start_agent_with_metrics(&node, metrics, "auto", &chain);
    // The ADDs come after a first scrape, so that rates and the latency quantiles see them.
    prometheus.wait_scraped();
    let pods = capture_pods(&node);
    let mut exposition = Exposition::parse(&agent.checked_metrics());
    for (family, kind, why) in NOT_IN_THIS_SCENARIO {
        assert!(
            exposition.family_of(family).is_none(),
            "{family} is in the scrape now, though {why}: take it off NOT_IN_THIS_SCENARIO"
        );
        exposition.declare(family, kind);
    }

    let answers = wait_until(SCRAPED, "every panel to show data", || {
        check_all(&prometheus, &exposition, &targets)
    });
    assert_silent_only_where_expected(&answers);
    // The node variable lists the agent's node.
    let (metric, label) = label_values_of(&dashboard, "instance").expect("label_values");
    assert!(exposition.family_of(&metric).is_some(), "{metric}");
    let nodes = prometheus.query(&format!("count by ({label}) ({metric})"));
    assert!(
        nodes.len() == 1 && nodes[0].labels.contains_key(&label),
        "{nodes:?}"
    );

    // The checker can fail: a series the agent does not export is named with its panel.
    let bogus = Target {
        panel: "Bogus".into(),
        ref_id: "A".into(),
        expr: "capture_no_such_series{instance=~\"$instance\"}".into(),
    };
    let err = check_target(&prometheus, &exposition, &bogus)
        .expect_err("a bogus series")
        .to_string();
    assert!(
        err.contains("panel \"Bogus\" (A)") && err.contains("capture_no_such_series"),
        "{err}"
    );

    for pod in &pods {
        node.del(pod).expect("DEL");
    }
    eprintln!(
        "{} queries of the dashboard checked in {:?}",
        targets.len(),
        started.elapsed()
    );
}
