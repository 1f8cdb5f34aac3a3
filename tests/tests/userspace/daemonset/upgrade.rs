//! An upgrade between two builds of the agent, as the DaemonSet rolls it, under the manifest's
//! restricted context.

use capture_tests::{
    cni::{Node, MESHED},
    daemonset,
};

use super::{
    inside::{container_of, exec_json, exec_json_of},
    node_with_the_daemonset, point_capture_cni_at_the_test_node, remove, run, sandbox_netns,
    wait_ready,
};

/// An upgrade as the DaemonSet rolls it, under the manifest's restricted context: the DaemonSet's
/// pod goes, and one whose agent is another build (the test's next-layout variant) takes the node
/// over in place. A connection held across it keeps its path through the proxy, new connections
/// go through it both ways, and the node's programs are the new build's.
#[test]
fn an_upgrade_between_two_builds_under_the_restricted_context_keeps_every_connection() {
    let node = Node::new();
    let Some((runtime, pod, agent, conflist)) = node_with_the_daemonset(&node) else {
        return;
    };
    point_capture_cni_at_the_test_node(&node, &conflist);
    let meshed = run(&runtime, "meshed", MESHED);
    let plain = run(&runtime, "plain", &[]);
    let to_plain = format!("{}:8080", plain.ip);
    let netns = sandbox_netns(&runtime, &meshed);
    // Captured: the kernel holds it as a connection to the proxy's outbound port.
    let held = crate::reconcile::hold_from_in(&runtime, &meshed, &netns, &to_plain, 10, |s| {
        s.remote.port() == 15001
    });
    let old_build = exec_json(
        &runtime,
        &container_of(&agent, "agent"),
        &["status", "--json"],
    )["build"]
        .clone();

    remove(&runtime, &agent.id);
    let next = runtime
        .run_node_agent(&with_the_variant_build(&pod), "capture-node-next")
        .expect("the next build's pod runs");
    wait_ready(&node, &runtime, &pod);
    let next_cid = container_of(&next, "agent");
    let status = exec_json_of(&runtime, &next_cid, VARIANT_BIN, &["status", "--json"]);
    assert_ne!(status["build"], old_build, "another build: {status}");
    assert_eq!(
        status["node_build"], status["build"],
        "taken over: {status}"
    );
    assert!(
        status["pods"]
            .as_array()
            .into_iter()
            .flatten()
            .all(|p| p["in_force"] == true),
        "{status}"
    );

    let held = held.join().expect("the hold thread");
    assert_eq!(held["ok"], true, "{held:#}");
    for exchange in ["first", "second"] {
        assert_eq!(held[exchange]["reply"]["server"], "outbound", "{held:#}");
        assert_eq!(
            held[exchange]["reply"]["orig"],
            to_plain.as_str(),
            "{held:#}"
        );
    }
    let got = runtime.connect_from(&meshed, "app", &to_plain);
    got.assert_served_by("outbound", "after the upgrade");
    let got = runtime.connect_from(&plain, "app", &format!("{}:8080", meshed.ip));
    got.assert_served_by("inbound", "after the upgrade");
    for p in [&meshed, &plain] {
        runtime.remove_pod(p).expect("removing a pod");
    }
    remove(&runtime, &next.id);
}

/// Where `with_the_variant_build` mounts the variant's `capture`.
const VARIANT_BIN: &str = "/opt/variant/capture";

/// The DaemonSet's pod with the agent of the test's variant build: the image's own context,
/// mounts and command line, the binary (and the one library it needs that the image lacks)
/// mounted read-only from the test's build.
fn with_the_variant_build(pod: &daemonset::NodeAgentPod) -> daemonset::NodeAgentPod {
    let mut next = pod.clone();
    let agent = next
        .containers
        .iter_mut()
        .find(|c| c.name == "agent")
        .expect("the agent container");
    let variant = capture_tests::variant_capture_bin();
    for (host, container) in [
        (variant.as_path(), VARIANT_BIN),
        (
            std::path::Path::new("/lib/x86_64-linux-gnu/libgcc_s.so.1"),
            "/opt/variant/lib/libgcc_s.so.1",
        ),
    ] {
        agent.mounts.push(daemonset::Mount {
            host_path: host.display().to_string(),
            container_path: container.to_string(),
            read_only: true,
            propagation: "None".to_string(),
        });
    }
    agent.argv[0] = VARIANT_BIN.to_string();
    agent.env.push((
        "LD_LIBRARY_PATH".to_string(),
        "/opt/variant/lib".to_string(),
    ));
    next
}
