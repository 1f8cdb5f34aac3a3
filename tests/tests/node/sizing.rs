//! The node's pod limit (`--max-pods`): the per-pod maps hold exactly that many pods at their
//! quotas (loopback destinations included), so however the pods on a node use their shares, the
//! last pod the limit allows is captured; one past it is refused (or, under `--mode auto`, falls
//! back to iptables); and the agent's start resizes a loaded node in place.

use capture_tests::{
    cni::Node,
    guards::ChildGuard,
    probe::{probe_in, Who},
    topology::Topology,
};
use serde_json::Value;

const MAX_PODS: usize = 4;

/// One row of `capture doctor --json`'s limits.
fn limit(topo: &Topology, map: &str) -> Value {
    let doctor = topo.capture(&["doctor", "--json"]);
    let report: Value = serde_json::from_slice(&doctor.stdout).expect("doctor JSON");
    report["limits"]
        .as_array()
        .and_then(|l| l.iter().find(|r| r["map"] == map))
        .unwrap_or_else(|| panic!("doctor lists {map}: {report}"))
        .clone()
}

/// How many entries of `what` a default pod has already: an attach one entry over the quota
/// says how many the pod needs, which is the listed ones plus those.
fn default_entries(
    topo: &Topology,
    sized: &[&str],
    (annotation, listed): (String, usize),
    what: &str,
) -> usize {
    let out = topo.try_attach(&[sized, &["--annotation", &annotation]].concat());
    assert!(
        !out.status.success(),
        "an attach over the {what} quota succeeded"
    );
    let err = String::from_utf8_lossy(&out.stderr);
    let needs = err
        .split("the pod needs ")
        .nth(1)
        .and_then(|rest| rest.split(' ').next())
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or_else(|| panic!("the refusal names the entries the pod needs: {err}"));
    needs - listed
}

fn ports_annotation(n: usize) -> String {
    let ports: Vec<String> = (1..=n).map(|p| p.to_string()).collect();
    format!(
        "traffic.sidecar.istio.io/excludeOutboundPorts={}",
        ports.join(",")
    )
}

fn ranges_annotation(n: usize) -> String {
    let ranges: Vec<String> = (0..n)
        .map(|i| format!("10.{}.{}.0/24", 100 + i / 256, i % 256))
        .collect();
    format!(
        "traffic.sidecar.istio.io/excludeOutboundIPRanges={}",
        ranges.join(",")
    )
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario, its steps in the order they happen"
)]
fn pods_at_every_quota_up_to_the_pod_limit_leave_room_for_the_last_one() {
    let node = Node::new();
    let mut pods: Vec<Topology> = (1..=MAX_PODS + 2)
        .map(|i| Topology::numbered(node.dirs.shared(), u8::try_from(i).expect("few pods")))
        .collect();
    let max_pods = MAX_PODS.to_string();
    let sized = ["--max-pods", max_pods.as_str()];

    // The first attach loads the node, sized for MAX_PODS pods; these refusals load it too.
    let (port_quota, cidr_quota, loopback_share) = (1024, 256, 512);
    let over_quota =
        |annotation: fn(usize) -> String, quota: usize| (annotation(quota + 1), quota + 1);
    let port_defaults = default_entries(
        &pods[0],
        &sized,
        over_quota(ports_annotation, port_quota),
        "port",
    );
    let cidr_defaults = default_entries(
        &pods[0],
        &sized,
        over_quota(ranges_annotation, cidr_quota),
        "CIDR",
    );
    let at_quota = [
        "--annotation".to_string(),
        ports_annotation(port_quota - port_defaults),
        "--annotation".to_string(),
        ranges_annotation(cidr_quota - cidr_defaults),
    ];
    let at_quota: Vec<&str> = at_quota.iter().map(String::as_str).collect();
    for topo in &pods[..MAX_PODS - 1] {
        topo.attach(&[&sized[..], &at_quota].concat());
    }
    let ports = limit(&pods[0], "PORT_LISTS");
    assert_eq!(ports["capacity"], MAX_PODS * port_quota, "{ports}");
    assert_eq!(ports["in_use"], (MAX_PODS - 1) * port_quota, "{ports}");
    let cidrs = limit(&pods[0], "CIDR_LISTS");
    assert_eq!(cidrs["capacity"], MAX_PODS * cidr_quota, "{cidrs}");
    assert_eq!(cidrs["in_use"], (MAX_PODS - 1) * cidr_quota, "{cidrs}");
    assert_eq!(limit(&pods[0], "POD_CONFIGS")["capacity"], MAX_PODS);

    // One of them connects to more destinations than it has loopback addresses (on a port its
    // exclusions leave captured): it holds at most its share of the stateless redirect's map,
    // and every connection reaches the proxy.
    pods[0].start_all();
    let destinations = loopback_share + 88;
    let mut flood = probe_in(
        &pods[0].pod.netns.path(),
        Some(&pods[0].pod.cgroup.path),
        Some(&Who::app()),
    );
    flood.args(["flood", "--count", &destinations.to_string()]);
    for i in 0..destinations {
        flood.args(["--to", &format!("10.200.{}.{}:8080", i / 256, i % 256)]);
    }
    let mut flood = ChildGuard::spawn(&mut flood);
    let report: Value = serde_json::from_str(flood.read_line().trim()).expect("flood report");
    assert_eq!(report["established"], destinations, "{report}");
    let loopback = limit(&pods[0], "LOOPBACK_DESTS");
    assert_eq!(
        loopback["capacity"],
        MAX_PODS * loopback_share,
        "{loopback}"
    );
    let held = loopback["in_use"].as_u64().expect("entries in use");
    if capture_tests::kernel::features().stateless_redirect {
        assert!(
            (400..=loopback_share as u64).contains(&held),
            "the pod holds at most its {loopback_share} addresses, most of them used: {loopback} (the node's features: {})",
            pods[0].node_features()
        );
    } else {
        // Before 5.15 every redirect takes the stateful path, which gives no address.
        assert_eq!(
            held,
            0,
            "{loopback} (the node's features: {})",
            pods[0].node_features()
        );
    }
    drop(flood);

    // The last pod the limit allows, with the default config: captured.
    let last = &mut pods[MAX_PODS - 1];
    last.attach(&[]);
    last.start_all();
    last.tcp(&Who::app(), "10.0.0.5:80").assert_served_by(
        "outbound",
        "the last pod of a node whose other pods are at their quotas",
    );

    // One more: refused on ebpf, naming the limit and the fix, with nothing of it written.
    let over = &pods[MAX_PODS];
    let out = over.try_attach(&[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "an attach past --max-pods succeeded");
    assert!(
        err.contains(&format!("--max-pods {MAX_PODS}")) && err.contains("maxPods"),
        "the refusal names the limit and the fix: {err}"
    );
    assert_eq!(limit(&pods[0], "POD_CONFIGS")["in_use"], MAX_PODS);
    // Under auto it falls back to iptables and is captured there.
    let over = &mut pods[MAX_PODS];
    over.attach(&["--mode", "auto"]);
    let status = over.status();
    let netns = over.pod.netns.path();
    let record = status["pods"]
        .as_array()
        .and_then(|pods| pods.iter().find(|p| p["netns"].as_str() == netns.to_str()))
        .unwrap_or_else(|| panic!("status lists the pod: {status}"));
    assert_eq!(record["mode"], "iptables", "{status}");
    assert!(
        record["fallback_reason"]
            .as_str()
            .is_some_and(|r| r.contains("--max-pods")),
        "{status}"
    );
    over.start_all();
    over.tcp(&Who::app(), "10.0.0.6:80")
        .assert_served_by("outbound", "the pod past the limit, on iptables");

    // The agent's start resizes the node in place: every pod stays captured, and the next
    // pod fits.
    let doubled = (2 * MAX_PODS).to_string();
    let agent = node.spawn_agent_of(
        &capture_tests::topology::capture_bin(),
        "ebpf",
        &["--max-pods", &doubled],
    );
    agent.wait_ready();
    assert_eq!(limit(&pods[0], "POD_CONFIGS")["capacity"], 2 * MAX_PODS);
    let ports = limit(&pods[0], "PORT_LISTS");
    assert_eq!(ports["capacity"], 2 * MAX_PODS * port_quota, "{ports}");
    assert_eq!(
        ports["in_use"].as_u64(),
        Some(((MAX_PODS - 1) * port_quota + port_defaults) as u64),
        "every pod's entries moved to the resized map: {ports}"
    );
    pods[MAX_PODS - 1]
        .tcp(&Who::app(), "10.0.0.7:80")
        .assert_served_by("outbound", "a pod after the resize");
    let next = &mut pods[MAX_PODS + 1];
    next.attach(&[]);
    next.start_all();
    next.tcp(&Who::app(), "10.0.0.8:80")
        .assert_served_by("outbound", "a pod the resized node had no room for before");
}
