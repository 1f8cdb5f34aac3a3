//! Prometheus text exposition for the agent: request outcomes, attach latency, the mode, and,
//! read fresh at each scrape, every pod's counters and the kernel-side error counters.

use std::{collections::BTreeMap, fmt::Write as _, sync::Mutex, time::Duration};

use crate::{ops::NodeStatus, probe::Check, record::Mode};

/// Upper bounds (seconds) of the attach latency histogram.
const LATENCY_BUCKETS: [f64; 12] = [
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
];

#[derive(Default)]
struct Histogram {
    counts: [u64; LATENCY_BUCKETS.len()],
    count: u64,
    sum: f64,
}

#[derive(Default)]
pub struct Metrics {
    attach_latency: Mutex<Histogram>,
    requests: Mutex<BTreeMap<(&'static str, &'static str), u64>>,
}

/// Escapes a label value.
fn label(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

impl Metrics {
    pub fn observe_attach(&self, took: Duration) {
        let secs = took.as_secs_f64();
        let mut h = self.attach_latency.lock().expect("metrics lock");
        for (i, bound) in LATENCY_BUCKETS.iter().enumerate() {
            if secs <= *bound {
                h.counts[i] += 1;
            }
        }
        h.count += 1;
        h.sum += secs;
    }

    pub fn count_request(&self, op: &'static str, ok: bool) {
        let result = if ok { "ok" } else { "error" };
        *self
            .requests
            .lock()
            .expect("metrics lock")
            .entry((op, result))
            .or_default() += 1;
    }

    /// The exposition text for one scrape.
    #[must_use]
    pub fn render(
        &self,
        mode: Mode,
        ready: bool,
        kernel_checks: &[Check],
        node: Option<&NodeStatus>,
    ) -> String {
        let mut o = String::new();
        let _ = writeln!(
            o,
            "# HELP capture_kernel_check What the agent found the kernel and node offer at start (1 usable); optional checks are needed by some pods only."
        );
        let _ = writeln!(o, "# TYPE capture_kernel_check gauge");
        for c in kernel_checks {
            let _ = writeln!(
                o,
                "capture_kernel_check{{check=\"{}\",optional=\"{}\"}} {}",
                label(&c.name),
                c.optional,
                u8::from(c.ok)
            );
        }
        let _ = writeln!(
            o,
            "# HELP capture_mode The capture backend this agent uses (1 for the active one)."
        );
        let _ = writeln!(o, "# TYPE capture_mode gauge");
        for m in [Mode::Ebpf, Mode::Iptables] {
            let _ = writeln!(o, "capture_mode{{mode=\"{m}\"}} {}", u8::from(m == mode));
        }
        let _ = writeln!(
            o,
            "# HELP capture_agent_ready Whether the agent serves capture requests."
        );
        let _ = writeln!(o, "# TYPE capture_agent_ready gauge");
        let _ = writeln!(o, "capture_agent_ready {}", u8::from(ready));

        let _ = writeln!(o, "# HELP capture_agent_requests_total Requests served on the agent socket, by operation and result.");
        let _ = writeln!(o, "# TYPE capture_agent_requests_total counter");
        for ((op, result), n) in self.requests.lock().expect("metrics lock").iter() {
            let _ = writeln!(
                o,
                "capture_agent_requests_total{{op=\"{op}\",result=\"{result}\"}} {n}"
            );
        }

        let h = self.attach_latency.lock().expect("metrics lock");
        let _ = writeln!(o, "# HELP capture_attach_duration_seconds Time from an attach request to capture in force.");
        let _ = writeln!(o, "# TYPE capture_attach_duration_seconds histogram");
        for (i, bound) in LATENCY_BUCKETS.iter().enumerate() {
            let _ = writeln!(
                o,
                "capture_attach_duration_seconds_bucket{{le=\"{bound}\"}} {}",
                h.counts[i]
            );
        }
        let _ = writeln!(
            o,
            "capture_attach_duration_seconds_bucket{{le=\"+Inf\"}} {}",
            h.count
        );
        let _ = writeln!(o, "capture_attach_duration_seconds_sum {}", h.sum);
        let _ = writeln!(o, "capture_attach_duration_seconds_count {}", h.count);
        drop(h);

        let Some(node) = node else { return o };
        let _ = writeln!(o, "# HELP capture_pods Pods captured on this node.");
        let _ = writeln!(o, "# TYPE capture_pods gauge");
        let _ = writeln!(o, "capture_pods {}", node.pods.len());
        let _ = writeln!(
            o,
            "# HELP capture_pod_in_force Whether capture is fully in force for the pod."
        );
        let _ = writeln!(o, "# TYPE capture_pod_in_force gauge");
        let _ = writeln!(
            o,
            "# HELP capture_pod_connections_total Connections decided by capture, by decision."
        );
        let _ = writeln!(o, "# TYPE capture_pod_connections_total counter");
        let _ = writeln!(o, "# HELP capture_pod_fallback Pods on iptables in auto mode because ebpf cannot serve them.");
        let _ = writeln!(o, "# TYPE capture_pod_fallback gauge");
        for pod in &node.pods {
            let r = &pod.record;
            let (ns, name) = r
                .pod
                .as_ref()
                .map_or(("", ""), |p| (p.namespace.as_str(), p.name.as_str()));
            let labels = format!(
                "namespace=\"{}\",pod=\"{}\",netns=\"{}\",mode=\"{}\"",
                label(ns),
                label(name),
                label(&r.netns.display().to_string()),
                r.mode
            );
            let _ = writeln!(
                o,
                "capture_pod_in_force{{{labels}}} {}",
                u8::from(pod.in_force)
            );
            if let Some(reason) = &r.fallback_reason {
                let _ = writeln!(
                    o,
                    "capture_pod_fallback{{{labels},reason=\"{}\"}} 1",
                    label(reason)
                );
            }
            if let Some(c) = &pod.counters {
                for (decision, n) in [
                    ("redirected_outbound", c.redirected_outbound),
                    ("redirected_inbound", c.redirected_inbound),
                    ("passed_owner", c.passed_owner),
                    ("passed_excluded", c.passed_excluded),
                    ("passed_local", c.passed_local),
                    ("captured_inbound", c.captured_inbound),
                    ("passed_inbound", c.passed_inbound),
                    ("refused_inbound", c.refused_inbound),
                    ("redirected_dns", c.redirected_dns),
                    ("error", c.errors),
                ] {
                    let _ = writeln!(
                        o,
                        "capture_pod_connections_total{{{labels},decision=\"{decision}\"}} {n}"
                    );
                }
            }
        }
        let _ = writeln!(
            o,
            "# HELP capture_kernel_errors_total Errors counted by the kernel programs, node-wide."
        );
        let _ = writeln!(o, "# TYPE capture_kernel_errors_total counter");
        for (kind, n) in &node.node_errors {
            let _ = writeln!(o, "capture_kernel_errors_total{{kind=\"{kind}\"}} {n}");
        }
        o
    }
}
