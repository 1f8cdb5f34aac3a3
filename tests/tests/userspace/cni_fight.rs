//! A neighbour that rewrites the node's CNI configuration on every change (Cilium with
//! `cni.exclusive=true`), with a real containerd: the agent chains capture-cni again less and less
//! often instead of fighting it, names the fight and its fix (status, metrics, readiness), and a
//! meshed pod created while capture-cni is not chained is captured in place by the reconcile.

use std::time::{Duration, Instant};

use capture_tests::{
    cni::{Node, MESHED},
    cni_neighbours::CiliumExclusive,
    containerd::Containerd,
    wait::wait_until,
};

use super::reconcile::{agent_args, captured, spec, wait_chain_loaded, wait_for_metric, PATIENCE};

/// The counter's value in a scrape.
fn counter(metrics: &str, name: &str) -> u64 {
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {metrics}"))
}

#[test]
fn a_neighbour_that_rewrites_on_every_change_is_named_not_fought_and_its_gap_repaired() {
    let node = Node::new();
    let installed = node.install_cni();
    let runtime = Containerd::start(&node);
    let conf_dir = node.conf_dir();
    let conf = conf_dir.to_str().unwrap();
    let bin = node.plugin_dir.to_str().unwrap();
    let mut args = agent_args(&runtime, conf, "capture");
    args.extend(["--watch-cni-config", "--cni-bin-dir", bin]);
    let agent = node.start_agent_with("ebpf", &args);

    // Cilium's own configuration: the node's network, under its name.
    let mut own = installed.clone();
    own["plugins"].as_array_mut().unwrap().truncate(1);
    own["name"] = "cilium".into();
    let started = Instant::now();
    let cilium = CiliumExclusive::start(&conf_dir, &own);

    wait_for_metric(&agent, "\ncapture_cni_chain_fight 1\n");
    let took = started.elapsed();
    let metrics = agent.checked_metrics();
    let rechained = counter(&metrics, "capture_cni_rechained_total");
    // Without the throttle, one re-chaining per look: four a second for as long as it runs.
    assert!(
        rechained <= 4,
        "{rechained} re-chainings in {took:?} ({} rewrites by the neighbour)",
        cilium.rewrites()
    );
    let chain = node.status()["cni_chain"].clone();
    let fight = &chain["fight"];
    assert_eq!(fight["neighbour"], "cilium_exclusive", "{chain:#}");
    assert!(
        fight["fix"]
            .as_str()
            .is_some_and(|f| f.contains("cni.exclusive=false")),
        "{chain:#}"
    );
    let shown = String::from_utf8_lossy(&node.capture(&["status"]).stdout).into_owned();
    assert!(
        shown.contains("FIGHT") && shown.contains("cni.exclusive=false"),
        "{shown}"
    );

    // Not chained between re-chainings: not ready, and saying why.
    let (code, why) = wait_until(
        PATIENCE,
        "the agent unready while unchained",
        || match agent.get("/readyz") {
            Some((503, why)) => Ok((503, why)),
            other => Err(format!("{other:?}")),
        },
    );
    assert!(
        code == 503 && why.contains("not chained") && why.contains("cni.exclusive=false"),
        "{why}"
    );

    // A meshed pod created in the gap starts uncaptured; the reconcile captures it in place.
    wait_chain_loaded(&runtime, false);
    let Some(gap) = runtime.run_pod_or_skip(&spec("gap", MESHED)) else {
        return;
    };
    wait_until(PATIENCE, "the gap's pod captured by the reconcile", || {
        if captured(&node, &gap) {
            Ok(())
        } else {
            Err(node.status()["reconcile"].to_string())
        }
    });

    // Once the neighbour is told (cni.exclusive=false: it stops renaming and rewriting), the
    // next re-chaining holds and the node is ready again.
    drop(cilium);
    let deadline = Duration::from_secs(70);
    wait_until(deadline, "capture-cni chained again", || {
        match agent.get("/readyz") {
            Some((200, _)) => Ok(()),
            other => Err(format!("{other:?}")),
        }
    });
    assert!(agent
        .checked_metrics()
        .contains("\ncapture_cni_chained 1\n"));
}
