//! The agent's metrics as a real Prometheus takes them: scraped from the metrics-only listener
//! (deploy/capture.yaml serves it on the node's address) and read back through Prometheus' query
//! API, as a dashboard or an alert would read them.

use capture_tests::{
    agent::http_request,
    cni::{CgroupDriver, Node, MESHED},
    probe::connect_with,
    prometheus::{free_loopback_addr, start_agent_with_metrics, Prometheus, SCRAPED},
};

/// Every label a capture series may carry: each names one of a bounded set of values (a pod's
/// identity, a build, a fixed word), never free text. Prometheus adds `instance` and `job`.
const LABELS: &[&str] = &[
    "__name__",
    "instance",
    "job",
    "namespace",
    "pod",
    "netns",
    "mode",
    "decision",
    "kind",
    "check",
    "optional",
    "build",
    // capture_build_info's: one value each per build, as `build`'s.
    "version",
    "commit",
    "programs",
    "target",
    "rustc",
    "cause",
    "op",
    "result",
    "le",
    "map",
];

#[test]
#[expect(
    clippy::float_cmp,
    reason = "Prometheus gives counters and gauges of whole numbers back exactly"
)]
fn prometheus_scrapes_the_agent_and_reads_pod_counters_back() {
    let node = Node::new();
    let metrics = free_loopback_addr();
    let agent = start_agent_with_metrics(&node, metrics, "ebpf", &[]);

    // The metrics listener serves /metrics and nothing else: health stays on --http.
    for (path, code) in [("/metrics", 200), ("/healthz", 404), ("/readyz", 404)] {
        let resp = http_request(metrics, "GET", path).expect("the metrics listener answers");
        assert_eq!(resp.code, code, "{path}: {}", resp.body);
    }
    assert_eq!(agent.get("/healthz").map(|(code, _)| code), Some(200));

    let mut a = node.pod("a", CgroupDriver::Cgroupfs, MESHED);
    let mut b = node.pod("b", CgroupDriver::Systemd, MESHED);
    node.add(&mut a).expect("ADD a");
    node.add(&mut b).expect("ADD b");
    let _servers = [a.start_servers(), b.start_servers()];
    const CALLS: usize = 3;
    for _ in 0..CALLS {
        let got = connect_with(a.app_client(), &format!("{}:8080", b.ip()));
        got.assert_served_by("outbound", "");
    }

    let prometheus = Prometheus::start(&[metrics]);
    prometheus.wait_scraped();
    prometheus.wait_for("capture_pods", SCRAPED, |s| {
        s.len() == 1 && s[0].value == 2.0
    });
    let redirected = "capture_pod_connections_total{pod=\"a\",decision=\"redirected_outbound\"}";
    let samples = prometheus.wait_for(redirected, SCRAPED, |s| {
        s.len() == 1 && s[0].value >= CALLS as f64
    });
    let labels = &samples[0].labels;
    assert_eq!(labels["mode"], "ebpf", "{labels:?}");
    // The node-wide maps' fill levels: one config per captured pod, out of the map's capacity.
    prometheus.wait_for("capture_map_entries{map=\"POD_CONFIGS\"}", SCRAPED, |s| {
        s.len() == 1 && s[0].value == 2.0
    });
    let paths = capture_user::paths::Paths::new(&node.dirs.bpffs, &node.dirs.state);
    let capacity = capture_user::ebpf::limits::node_limits(
        &paths,
        capture_user::ebpf::sizing::NodeSizing::default(),
    )
    .iter()
    .find(|l| l.map == "POD_CONFIGS")
    .map(|l| f64::from(l.capacity))
    .expect("POD_CONFIGS in the node's limits");
    prometheus.wait_for("capture_map_capacity{map=\"POD_CONFIGS\"}", SCRAPED, |s| {
        s.len() == 1 && s[0].value == capacity
    });
    assert_eq!(labels["namespace"], "default", "{labels:?}");
    // What Prometheus stored is what the agent counts (no traffic runs any more).
    let scrape = agent.checked_metrics();
    let direct = scrape
        .lines()
        .find(|l| {
            l.starts_with("capture_pod_connections_total{")
                && l.contains("pod=\"a\"")
                && l.contains("decision=\"redirected_outbound\"")
        })
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse::<f64>().ok())
        .unwrap_or_else(|| panic!("no counter for pod a in\n{scrape}"));
    prometheus.wait_for(redirected, SCRAPED, |s| {
        s.len() == 1 && s[0].value == direct
    });

    for sample in prometheus.query("{__name__=~\"capture_.+\"}") {
        for label in sample.labels.keys() {
            assert!(
                LABELS.contains(&label.as_str()),
                "label {label} is not one of the bounded ones: {sample:?}"
            );
        }
    }
    assert!(
        prometheus.target_errors().iter().all(String::is_empty),
        "scrape errors: {:?}",
        prometheus.target_errors()
    );

    // A released pod's series end: Prometheus marks them stale at the next scrape.
    node.del(&b).expect("DEL b");
    prometheus.wait_for("capture_pods", SCRAPED, |s| {
        s.len() == 1 && s[0].value == 1.0
    });
    prometheus.wait_for("capture_pod_in_force{pod=\"b\"}", SCRAPED, <[_]>::is_empty);
    node.del(&a).expect("DEL a");
}
