//! The agent's Prometheus metrics, kept in a prometheus-client registry: what the agent counts
//! itself (socket requests, attach latency), what it found at start (mode, kernel checks), its
//! readiness, and a collector (`node_metrics.rs`) that reads the per-pod series and the kernel-side
//! error counters from the node at each scrape.
//!
//! The exposition is the Prometheus text format 0.0.4, not OpenMetrics: it is what every
//! Prometheus scrapes and what `promtool check metrics` validates, and nothing exported here
//! (no exemplars, units or `_created` series) needs OpenMetrics.

use std::time::Duration;

use prometheus_client::{
    encoding::{prometheus_text, EncodeLabelSet},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

use capture_model::api::{self, FailureKind, Response};

use super::node_metrics::{NodeCollector, ReadNode};
use crate::{probe::Check, record::Mode};

/// The longest ADD the histogram takes: an hour, beyond any plugin's timeout.
const MAX_CNI_ADD_NS: u64 = 3_600 * 1_000_000_000;

/// The `Content-Type` of what [`Metrics::encode`] writes.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// Upper bounds (seconds) of the attach latency histogram.
const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CheckLabels {
    check: String,
    optional: bool,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    op: &'static str,
    result: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct CniAddLabels {
    mode: String,
    result: &'static str,
}

/// One latency histogram per label set.
type Histograms<L> = Family<L, Histogram, fn() -> Histogram>;

fn latency_histogram() -> Histogram {
    Histogram::new(LATENCY_BUCKETS)
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RepairLabels {
    action: String,
    result: &'static str,
}

/// The registry and handles on the metrics the agent updates. The handles share their values
/// with the registry (prometheus-client metrics are shared on clone).
pub struct Metrics {
    registry: Registry,
    ready: Gauge,
    requests: Family<RequestLabels, Counter>,
    attach_duration: Histogram,
    cni_add_duration: Histograms<CniAddLabels>,
    cni_rechained: Counter,
    uncaptured: Gauge,
    runtime_reachable: Gauge,
    repairs: Family<RepairLabels, Counter>,
    left_open: Counter,
    proxy_settings: Family<ResultLabels, Counter>,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: &'static str,
}

/// The agent's build, twice: `capture_agent_build` (its name on a node) and
/// `capture_build_info` (what `capture version` prints).
fn register_build(registry: &mut Registry) {
    let one = |labels: Vec<(&'static str, String)>| {
        let family = Family::<Vec<(&'static str, String)>, Gauge>::default();
        family.get_or_create(&labels).set(1);
        family
    };
    registry.register(
        "capture_agent_build",
        "This agent's build (package version and kernel-program object id)",
        one(vec![("build", crate::ebpf::loader::build_name())]),
    );
    let info = crate::build_info::this();
    registry.register(
        "capture_build_info",
        "What this agent is built from: version, commit, kernel programs, target, rustc (always 1)",
        one(vec![
            ("version", info.version.to_string()),
            ("commit", info.commit.to_string()),
            ("programs", info.programs),
            ("target", info.target.to_string()),
            ("rustc", info.rustc.to_string()),
        ]),
    );
}

impl Metrics {
    /// The registry for an agent in `mode` that found `kernel_checks` at start; `read_node`
    /// gives the node's status at each scrape (None leaves the node series out).
    pub fn new(mode: Mode, kernel_checks: &[Check], read_node: ReadNode) -> Self {
        // prometheus-client ends every help text with a full stop itself, and appends `_total`
        // to counter names.
        let mut registry = Registry::default();
        registry.register(
            "capture_kernel_check",
            "What the agent found the kernel and node offer at start (1 usable); optional checks are needed by some pods only",
            kernel_check_gauges(kernel_checks),
        );
        registry.register(
            "capture_mode",
            "The capture backend this agent uses (1 for the active one)",
            mode_gauges(mode),
        );
        register_build(&mut registry);
        let ready = Gauge::default();
        registry.register(
            "capture_agent_ready",
            "Whether the agent serves capture requests",
            ready.clone(),
        );
        let requests = Family::<RequestLabels, Counter>::default();
        registry.register(
            "capture_agent_requests",
            "Requests served on the agent socket, by operation and result",
            requests.clone(),
        );
        let attach_duration = Histogram::new(LATENCY_BUCKETS);
        registry.register(
            "capture_attach_duration_seconds",
            "Time from an attach request to capture in force",
            attach_duration.clone(),
        );
        let cni_add_duration: Histograms<CniAddLabels> =
            Family::new_with_constructor(latency_histogram);
        // The ADDs that capture their pod with the agent's mode, at zero from the start: a
        // series first scraped after its first ADD would show Prometheus no increase in it.
        drop(cni_add_duration.get_or_create(&CniAddLabels {
            mode: mode.to_string(),
            result: "ok",
        }));
        registry.register(
            "capture_cni_add_duration_seconds",
            "CNI ADD as the plugin sees it, from capture-cni's start to the agent's answer, by the backend that captured the pod (the agent's mode where none did) and result",
            cni_add_duration.clone(),
        );
        let cni_rechained = Counter::default();
        registry.register(
            "capture_cni_rechained",
            "Times the agent chained capture-cni again after the network plugin's configuration dropped it",
            cni_rechained.clone(),
        );
        let uncaptured = Gauge::default();
        registry.register(
            "capture_pods_uncaptured",
            "Meshed pod sandboxes of the node's runtime that run without capture, at the last reconcile",
            uncaptured.clone(),
        );
        let runtime_reachable = Gauge::default();
        registry.register(
            "capture_runtime_reachable",
            "Whether the last reconcile could read the container runtime over CRI",
            runtime_reachable.clone(),
        );
        let repairs = Family::<RepairLabels, Counter>::default();
        registry.register(
            "capture_repairs",
            "What the reconcile did: capture, restart or report a meshed pod found uncaptured, release a pod whose sandbox is gone; by result",
            repairs.clone(),
        );
        let left_open = Counter::default();
        registry.register(
            "capture_repair_connections_left_open",
            "TCP connections a pod had open when the reconcile captured it in place: they keep the path they were opened on, only new ones go through the proxy",
            left_open.clone(),
        );
        registry.register_collector(Box::new(NodeCollector::new(read_node)));
        let proxy_settings = Family::<ResultLabels, Counter>::default();
        registry.register(
            "capture_proxy_settings",
            "Proxy containers learned from the runtime and what their settings did to the pod's capture: unchanged, applied, refused (a setting that cannot be read) or failed",
            proxy_settings.clone(),
        );
        Self {
            registry,
            ready,
            requests,
            attach_duration,
            cni_add_duration,
            cni_rechained,
            uncaptured,
            runtime_reachable,
            repairs,
            left_open,
            proxy_settings,
        }
    }

    /// Adds the node-wide maps' fill levels (read from the pins under `paths` at each scrape).
    #[must_use]
    pub fn with_map_fill(
        mut self,
        paths: crate::paths::Paths,
        sizing: crate::ebpf::sizing::NodeSizing,
    ) -> Self {
        self.registry
            .register_collector(Box::new(super::map_metrics::MapsCollector::new(
                paths, sizing,
            )));
        self
    }

    pub fn set_uncaptured(&self, pods: usize) {
        self.uncaptured.set(i64::try_from(pods).unwrap_or(i64::MAX));
    }

    pub fn set_runtime_reachable(&self, reachable: bool) {
        self.runtime_reachable.set(i64::from(reachable));
    }

    pub fn count_repair(&self, action: &str, ok: bool) {
        let labels = RepairLabels {
            action: action.to_owned(),
            result: if ok { "ok" } else { "failed" },
        };
        self.repairs.get_or_create(&labels).inc();
    }

    pub fn count_proxy_settings(&self, result: &'static str) {
        self.proxy_settings
            .get_or_create(&ResultLabels { result })
            .inc();
    }

    pub fn count_left_open(&self, connections: usize) {
        self.left_open
            .inc_by(u64::try_from(connections).unwrap_or(u64::MAX));
    }

    pub fn set_ready(&self, ready: bool) {
        self.ready.set(i64::from(ready));
    }

    pub fn observe_attach(&self, took: Duration) {
        self.attach_duration.observe(took.as_secs_f64());
    }

    /// A CNI ADD answered: from the plugin's start (`plugin_started_ns`, on the clock of
    /// `api::plugin_clock_ns`) to now. A request without the plugin's start (another client, an
    /// earlier plugin) is not one.
    pub fn observe_cni_add(&self, mode: Mode, response: &Response, plugin_started_ns: Option<u64>) {
        let Some(took) = plugin_started_ns
            .zip(api::plugin_clock_ns())
            .and_then(|(started, now)| now.checked_sub(started))
        else {
            return;
        };
        // Beyond any plugin's timeout: a start told on another clock, not an ADD's time.
        if took > MAX_CNI_ADD_NS {
            return;
        }
        let result = match response.kind {
            None => "ok",
            Some(FailureKind::NotReady) => "not_ready",
            Some(FailureKind::InvalidConfig) => "invalid_config",
            Some(FailureKind::CaptureFailed) => "capture_failed",
            Some(FailureKind::BadRequest) => "bad_request",
        };
        let labels = CniAddLabels {
            mode: response.mode.unwrap_or(mode).to_string(),
            result,
        };
        #[expect(
            clippy::cast_precision_loss,
            reason = "nanoseconds below an hour are exact in an f64"
        )]
        let seconds = took as f64 / 1e9;
        self.cni_add_duration
            .get_or_create(&labels)
            .observe(seconds);
    }

    /// The series the CNI watcher keeps (shared with the registry): the re-chaining counter,
    /// and, registered here as the watcher runs, whether capture-cni is chained and whether
    /// something keeps taking it out.
    pub fn cni_chain(&mut self) -> super::cni_watch::ChainMetrics {
        let chain = super::cni_watch::ChainMetrics {
            rechained: self.cni_rechained.clone(),
            ..super::cni_watch::ChainMetrics::default()
        };
        self.registry.register(
            "capture_cni_chained",
            "1 while capture-cni is in the node's active CNI configuration (with --watch-cni-config)",
            chain.chained.clone(),
        );
        self.registry.register(
            "capture_cni_chain_fight",
            "1 while something keeps rewriting the node's CNI configuration without capture-cni (see capture status)",
            chain.fighting.clone(),
        );
        chain
    }

    pub fn count_request(&self, op: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        self.requests
            .get_or_create(&RequestLabels { op, result })
            .inc();
    }

    /// The exposition for one scrape. It reads the node (pins and pod records), so call it where
    /// blocking is allowed.
    pub fn encode(&self) -> Result<String, std::fmt::Error> {
        let mut out = String::new();
        prometheus_text::encode(&mut out, &self.registry)?;
        Ok(out)
    }
}

fn kernel_check_gauges(checks: &[Check]) -> Family<CheckLabels, Gauge> {
    let family = Family::<CheckLabels, Gauge>::default();
    for c in checks {
        let labels = CheckLabels {
            check: c.name.clone(),
            optional: c.optional,
        };
        family.get_or_create(&labels).set(i64::from(c.ok));
    }
    family
}

/// Every mode, 1 for the active one, so a dashboard can tell "not ebpf" from "no data".
fn mode_gauges(active: Mode) -> Family<ModeLabels, Gauge> {
    let family = Family::<ModeLabels, Gauge>::default();
    for m in [Mode::Ebpf, Mode::Iptables, Mode::Nftables] {
        let labels = ModeLabels {
            mode: m.to_string(),
        };
        family.get_or_create(&labels).set(i64::from(m == active));
    }
    family
}

#[cfg(test)]
#[path = "metrics_tests.rs"]
mod tests;
