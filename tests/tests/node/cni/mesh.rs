//! Istio's mesh configuration through the agent (`--mesh-config`, the `istio` ConfigMap's `mesh`
//! key): DNS capture on mesh-wide and off for one pod by its `proxy.istio.io/config`, a change of
//! the file applying to the pods created afterwards, a file that cannot be used keeping the last
//! good one, and an agent that has never had a good one not ready and saying why.

use capture_tests::{
    cni::{error_code, pod_status, CgroupDriver, Node, Pod},
    guards::ChildGuard,
    injected,
    probe::{connect_opts, probe_in, ConnectOpts, Outcome, Who},
};
use serde_json::Value;

const MESH_DNS_ON: &str = "defaultConfig:\n  discoveryAddress: istiod.istio-system.svc:15012\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n    ISTIO_META_DNS_AUTO_ALLOCATE: \"true\"\nenablePrometheusMerge: true\ntrustDomain: cluster.local\n";
const MESH_DNS_OFF: &str =
    "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"false\"\n";
const POD_DNS_OFF: &str = "proxyMetadata:\n  ISTIO_META_DNS_CAPTURE: \"false\"\n";

/// The pod's proxy, with its DNS proxy on 15053 (what istio-agent runs when DNS capture is on).
fn start_dns_proxy(pod: &Pod) -> ChildGuard {
    let mut cmd = probe_in(&pod.netns.path(), Some(&pod.cgroup), Some(&Who::proxy()));
    cmd.args(["serve", "--udp", "dns=127.0.0.1:15053"]);
    ChildGuard::spawn_ready(&mut cmd)
}

/// A DNS query from the pod's app to `resolver` port 53: the pod's DNS proxy answers when its
/// DNS is captured, the resolver's server when not.
fn query(pod: &Pod, resolver: &Pod) -> Outcome {
    connect_opts(
        probe_in(&pod.netns.path(), Some(&pod.cgroup), Some(&Who::app())),
        &format!("{}:53", resolver.ip()),
        &ConnectOpts {
            udp: true,
            ..ConnectOpts::default()
        },
    )
}

fn sidecar_with(extra: &[(&'static str, &'static str)]) -> Vec<(&'static str, &'static str)> {
    injected::SIDECAR.iter().chain(extra).copied().collect()
}

/// The pod's effective setting `name` from `capture status`.
fn setting(status: &Value, pod: &str, name: &str) -> Value {
    pod_status(status, pod)["settings"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["name"] == name)
        .unwrap_or_else(|| panic!("no {name} for {pod}"))
        .clone()
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario through the agent, its steps in the order they happen"
)]
fn dns_capture_from_the_mesh_configuration_and_a_pods_own() {
    let node = Node::new();
    let mesh = node.scratch_file("istio/mesh");
    std::fs::write(&mesh, MESH_DNS_ON).unwrap();
    let mesh_arg = mesh.to_str().unwrap();
    let mut agent = node.start_agent_with("ebpf", &["--mesh-config", mesh_arg]);

    // Not meshed: a DNS server elsewhere, which answers what capture lets through.
    let mut resolver = node.pod("resolver", CgroupDriver::Cgroupfs, &[]);
    node.add(&mut resolver).expect("ADD resolver");
    let _resolver = {
        let mut cmd = probe_in(&resolver.netns.path(), None, None);
        cmd.args(["serve", "--udp", "app=0.0.0.0:53"]);
        ChildGuard::spawn_ready(&mut cmd)
    };

    let mut mesh_wide = node.pod("mesh-wide", CgroupDriver::Systemd, injected::SIDECAR);
    let mut opted_out = node.pod(
        "opted-out",
        CgroupDriver::Cgroupfs,
        &sidecar_with(&[("proxy.istio.io/config", POD_DNS_OFF)]),
    );
    node.add(&mut mesh_wide).expect("ADD");
    node.add(&mut opted_out).expect("ADD opted-out");
    let _proxies = [start_dns_proxy(&mesh_wide), start_dns_proxy(&opted_out)];
    query(&mesh_wide, &resolver).assert_served_by("dns", "mesh-wide DNS capture");
    query(&opted_out, &resolver).assert_served_by("app", "a pod that turned it off");

    let status = node.status();
    assert_eq!(
        status["mesh_config"]["in_use"]["proxy_metadata"]["ISTIO_META_DNS_CAPTURE"], true,
        "{}",
        status["mesh_config"]
    );
    let dns = setting(&status, "mesh-wide", "dns_capture");
    assert_eq!(
        (&dns["value"], &dns["source"]),
        (&"true".into(), &"mesh".into()),
        "{dns}"
    );
    let dns = setting(&status, "opted-out", "dns_capture");
    assert_eq!(
        (&dns["value"], &dns["source"]),
        (&"false".into(), &"annotation".into()),
        "{dns}"
    );
    assert_eq!(dns["overrides"][0]["source"], "mesh", "{dns}");

    // The mesh turns DNS capture off: pods created afterwards follow, the others keep theirs.
    std::fs::write(&mesh, MESH_DNS_OFF).unwrap();
    let mut later = node.pod("later", CgroupDriver::Systemd, injected::SIDECAR);
    node.add(&mut later).expect("ADD after the change");
    let _later_proxy = start_dns_proxy(&later);
    query(&later, &resolver).assert_served_by("app", "a pod after the mesh turned DNS off");
    query(&mesh_wide, &resolver).assert_served_by("dns", "a pod set up before the change");

    // A file that cannot be used: new pods get the last good one, and status says why.
    std::fs::write(&mesh, "defaultConfig: [").unwrap();
    let mut after_bad = node.pod("after-bad", CgroupDriver::Cgroupfs, injected::SIDECAR);
    node.add(&mut after_bad).expect("ADD with a bad file");
    assert_eq!(agent.get("/readyz").map(|r| r.0), Some(200));
    let status = node.status();
    assert!(
        status["mesh_config"]["problem"]
            .as_str()
            .is_some_and(|p| p.contains("not YAML")),
        "{}",
        status["mesh_config"]
    );
    assert_eq!(
        setting(&status, "after-bad", "dns_capture")["value"],
        "false",
        "the last good file's"
    );
    for pod in [&mesh_wide, &opted_out, &later, &after_bad] {
        node.del(pod).expect("DEL");
    }

    // An agent that starts with a file it cannot use is not ready, says why, and turns ready
    // once the file is fixed.
    agent.stop();
    let mut agent = node.spawn_agent_of(
        &capture_tests::topology::capture_bin(),
        "ebpf",
        &["--mesh-config", mesh_arg],
    );
    // Not ready from its first answer, and (once its programs are loaded) for the file alone.
    let (code, body) = agent.wait_answer("/readyz");
    assert_eq!(code, 503, "{body}");
    assert!(
        body.contains(mesh_arg) && body.contains("not YAML"),
        "{body}"
    );
    capture_tests::wait::wait_until(
        std::time::Duration::from_mins(2),
        "the agent to have loaded its programs",
        || match agent.get("/readyz") {
            Some((503, body)) if !body.contains("starting") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let mut first = node.pod("first", CgroupDriver::Systemd, injected::SIDECAR);
    let refused = node
        .add(&mut first)
        .expect_err("ADD before a usable mesh configuration");
    assert_eq!(error_code(&refused), Some(11), "{refused}");
    assert!(refused.to_string().contains(mesh_arg), "{refused}");
    std::fs::write(&mesh, MESH_DNS_ON).unwrap();
    agent.wait_ready();
    node.add(&mut first).expect("ADD once the file is fixed");
    let _first_proxy = start_dns_proxy(&first);
    query(&first, &resolver).assert_served_by("dns", "DNS capture from the fixed file");
    node.del(&first).expect("DEL");
    node.del(&resolver).expect("DEL resolver");
    agent.stop();
}

/// The mesh's interception mode for a pod without its own: TPROXY, which the ebpf backend does
/// not implement, so the agent's `auto` mode captures the pod with iptables and says why; a pod
/// whose annotation says REDIRECT stays on ebpf.
#[test]
fn the_mesh_interception_mode_applies_to_pods_without_their_own() {
    let node = Node::new();
    let mesh = node.scratch_file("istio/mesh");
    std::fs::write(&mesh, "defaultConfig:\n  interceptionMode: TPROXY\n").unwrap();
    let _agent = node.start_agent_with("auto", &["--mesh-config", mesh.to_str().unwrap()]);
    let mut tproxy = node.pod("tproxy", CgroupDriver::Systemd, injected::SIDECAR);
    let mut redirect = node.pod(
        "redirect",
        CgroupDriver::Cgroupfs,
        &sidecar_with(&[("sidecar.istio.io/interceptionMode", "REDIRECT")]),
    );
    node.add(&mut tproxy).expect("ADD");
    node.add(&mut redirect).expect("ADD redirect");
    let status = node.status();
    let pod = |name: &str| pod_status(&status, name).clone();
    assert_eq!(
        (&pod("tproxy")["mode"], &pod("tproxy")["fallback_cause"]),
        (&"iptables".into(), &"tproxy".into())
    );
    let mode = setting(&status, "tproxy", "interception_mode");
    assert_eq!(
        (&mode["value"], &mode["source"]),
        (&"TPROXY".into(), &"mesh".into())
    );
    assert_eq!(pod("redirect")["mode"], "ebpf");
    let mode = setting(&status, "redirect", "interception_mode");
    assert_eq!(mode["source"], "annotation");
    assert_eq!(mode["overrides"][0]["value"], "TPROXY", "{mode}");
    for p in [&tproxy, &redirect] {
        node.del(p).expect("DEL");
    }
}
