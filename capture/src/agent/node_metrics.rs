//! The series read from the node at each scrape: captured pods, whether capture is in force for
//! each, why a pod fell back to iptables, each pod's connection counters, and the kernel
//! programs' node-wide error counters. They are read fresh (pod records, pinned links and maps)
//! rather than kept in the registry, so a released pod's series go with it and the kernel's
//! counters are never stale.

use std::fmt;

use prometheus_client::{
    collector::Collector,
    encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric},
    metrics::{counter::ConstCounter, gauge::ConstGauge},
};

use crate::{
    config::FallbackCause,
    ops::{NodeStatus, PodStatus},
};

/// Reads the node's status for a scrape; None when it cannot be read (then the node's series
/// are left out of that scrape).
pub type ReadNode = Box<dyn Fn() -> Option<NodeStatus> + Send + Sync>;

/// A pod's identifying labels: `namespace`, `pod`, `netns`, `mode`.
type PodLabels = [(&'static str, String); 4];

pub struct NodeCollector {
    read: ReadNode,
}

impl NodeCollector {
    pub fn new(read: ReadNode) -> Self {
        Self { read }
    }
}

impl fmt::Debug for NodeCollector {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("NodeCollector").finish_non_exhaustive()
    }
}

impl Collector for NodeCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> fmt::Result {
        match (self.read)() {
            Some(node) => encode_node(&mut encoder, &node),
            None => Ok(()),
        }
    }
}

fn encode_node(encoder: &mut DescriptorEncoder, node: &NodeStatus) -> fmt::Result {
    let pods: Vec<(PodLabels, &PodStatus)> = node.pods.iter().map(|p| (pod_labels(p), p)).collect();
    ConstGauge::new(node.pods.len()).encode(encoder.encode_descriptor(
        "capture_pods",
        "Pods captured on this node.",
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?)?;
    ConstGauge::new(node.damaged_records.len()).encode(encoder.encode_descriptor(
        "capture_damaged_records",
        "Pod records that cannot be read back; their pods are left out until CNI DEL releases them.",
        None,
        prometheus_client::metrics::MetricType::Gauge,
    )?)?;

    encode_pod_states(encoder, &pods)?;
    encode_left_alone_and_builds(encoder, node)?;
    encode_acceleration(encoder, &pods)?;
    encode_traffic(encoder, node, &pods)
}

/// Each pod's state: in force, on a fallback, its programs' build, its loopback destinations.
fn encode_pod_states(
    encoder: &mut DescriptorEncoder,
    pods: &[(PodLabels, &PodStatus)],
) -> fmt::Result {
    let in_force: Vec<_> = pods
        .iter()
        .map(|(labels, p)| (&labels[..], ConstGauge::new(i64::from(p.in_force))))
        .collect();
    family(
        encoder,
        "capture_pod_in_force",
        "Whether capture is fully in force for the pod.",
        &in_force,
    )?;

    let fallback: Vec<_> = pods
        .iter()
        .filter_map(|(labels, p)| {
            p.record.fallback_reason.as_ref()?;
            // A bounded label: the words are in `capture status`, not in the series.
            let cause = p
                .record
                .fallback_cause
                .map_or("unknown", FallbackCause::as_str);
            Some(((&labels[..], [("cause", cause)]), ConstGauge::new(1)))
        })
        .collect();
    family(
        encoder,
        "capture_pod_fallback",
        "Pods on iptables in auto mode because ebpf cannot serve them, by cause (capture status gives the reason).",
        &fallback,
    )?;

    let builds: Vec<_> = pods
        .iter()
        .filter_map(|(labels, p)| {
            let build = p.program_build.as_deref()?;
            Some(((&labels[..], [("build", build)]), ConstGauge::new(1)))
        })
        .collect();
    family(
        encoder,
        "capture_pod_program_build",
        "The build of the kernel programs capturing the pod (ebpf pods); during a takeover some \
         pods run the old build's, after one every pod runs the node's.",
        &builds,
    )?;

    let loopback: Vec<_> = pods
        .iter()
        .filter_map(|(labels, p)| {
            let n = i64::try_from(p.loopback_destinations?).ok()?;
            Some((&labels[..], ConstGauge::new(n)))
        })
        .collect();
    family(
        encoder,
        "capture_pod_loopback_destinations",
        &format!(
            "Destinations the pod has a loopback address of the stateless redirect for (ebpf \
             pods); at {}, connections to new destinations take the stateful path.",
            capture_common::loopback::POD_LOOPBACK_QUOTA
        ),
        &loopback,
    )?;
    Ok(())
}

/// Pods left alone, and the build the node has pinned.
fn encode_left_alone_and_builds(encoder: &mut DescriptorEncoder, node: &NodeStatus) -> fmt::Result {
    let left_alone: Vec<_> = node
        .left_alone
        .iter()
        .map(|l| {
            let labels = [
                ("namespace", l.pod.namespace.as_str()),
                ("pod", l.pod.name.as_str()),
                ("reason", l.reason.as_str()),
            ];
            (labels, ConstGauge::new(1))
        })
        .collect();
    family(
        encoder,
        "capture_pod_left_alone",
        "Pods Istio injected that capture leaves alone, as istio-cni does, by reason (istio_init: \
         Istio's own rules redirect the pod; gateway; no_proxy_container; injection_disabled; \
         excluded_namespace).",
        &left_alone,
    )?;

    let node_build: Vec<_> = node
        .node_build
        .iter()
        .map(|b| ([("build", b.as_str())], ConstGauge::new(1)))
        .collect();
    family(
        encoder,
        "capture_node_program_build",
        "The build whose kernel programs the node has pinned (its node record).",
        &node_build,
    )?;
    Ok(())
}

/// The app-to-proxy acceleration of the pods that ask for it.
fn encode_acceleration(
    encoder: &mut DescriptorEncoder,
    pods: &[(PodLabels, &PodStatus)],
) -> fmt::Result {
    let accelerated: Vec<_> = pods
        .iter()
        .filter_map(|(labels, p)| {
            let accel = p.acceleration.as_ref()?;
            Some((&labels[..], ConstGauge::new(i64::from(accel.active))))
        })
        .collect();
    family(
        encoder,
        "capture_pod_accelerated",
        "For pods that ask for the app-to-proxy acceleration: whether they have it (capture status says why not).",
        &accelerated,
    )?;
    let accel_bytes: Vec<_> = pods
        .iter()
        .filter_map(|(labels, p)| {
            let c = p.acceleration.as_ref()?.counters?;
            Some((&labels[..], ConstCounter::new(c.accelerated_bytes)))
        })
        .collect();
    family(
        encoder,
        "capture_pod_accelerated_bytes",
        "Bytes the acceleration moved straight between the pod's app and proxy sockets.",
        &accel_bytes,
    )?;
    let accel_sends: Vec<_> = pods
        .iter()
        .flat_map(|(labels, p)| {
            let c = p.acceleration.as_ref().and_then(|a| a.counters);
            c.into_iter().flat_map(move |c| {
                [
                    ("accelerated", c.accelerated_sends),
                    ("tcp", c.unaccelerated_sends),
                ]
                .map(|(path, n)| ((&labels[..], [("path", path)]), ConstCounter::new(n)))
            })
        })
        .collect();
    family(
        encoder,
        "capture_pod_accelerated_socket_directions",
        "Socket directions of accelerated pods by the path their writes took (decided at each socket's first write).",
        &accel_sends,
    )?;
    Ok(())
}

/// Connections decided, the kernel's errors and the trace's events.
fn encode_traffic(
    encoder: &mut DescriptorEncoder,
    node: &NodeStatus,
    pods: &[(PodLabels, &PodStatus)],
) -> fmt::Result {
    let connections: Vec<_> = pods
        .iter()
        .flat_map(|(labels, p)| {
            decisions(p)
                .into_iter()
                .map(move |(decision, n)| ((&labels[..], [("decision", decision)]), n))
        })
        .map(|(labels, n)| (labels, ConstCounter::new(n)))
        .collect();
    family(
        encoder,
        "capture_pod_connections",
        "Connections decided by capture, by decision.",
        &connections,
    )?;

    let errors: Vec<_> = node
        .node_errors
        .iter()
        .map(|(kind, n)| ([("kind", *kind)], ConstCounter::new(*n)))
        .collect();
    family(
        encoder,
        "capture_kernel_errors",
        "Errors counted by the kernel programs, node-wide.",
        &errors,
    )?;

    if let Some(trace) = &node.trace {
        ConstGauge::new(i64::from(trace.traced_pods)).encode(encoder.encode_descriptor(
            "capture_traced_pods",
            "Pods whose decisions `capture trace` streams now.",
            None,
            prometheus_client::metrics::MetricType::Gauge,
        )?)?;
        let events = [
            ([("result", "emitted")], ConstCounter::new(trace.emitted)),
            ([("result", "dropped")], ConstCounter::new(trace.dropped)),
        ];
        family(
            encoder,
            "capture_trace_events",
            "Decisions of traced pods, emitted to `capture trace` or dropped (its rate limit, a full buffer).",
            &events,
        )?;
    }
    Ok(())
}

/// One metric family: its HELP and TYPE, then one sample per label set. A family without samples
/// is left out entirely, as the registry does with its own empty families. prometheus-client
/// appends `_total` to counter names.
pub(super) fn family<L: EncodeLabelSet, M: EncodeMetric>(
    encoder: &mut DescriptorEncoder,
    name: &str,
    help: &str,
    samples: &[(L, M)],
) -> fmt::Result {
    let Some((_, first)) = samples.first() else {
        return Ok(());
    };
    let mut descriptor = encoder.encode_descriptor(name, help, None, first.metric_type())?;
    for (labels, metric) in samples {
        metric.encode(descriptor.encode_family(labels)?)?;
    }
    Ok(())
}

fn pod_labels(pod: &PodStatus) -> PodLabels {
    let r = &pod.record;
    let (namespace, name) = r
        .pod
        .as_ref()
        .map_or(("", ""), |p| (p.namespace.as_str(), p.name.as_str()));
    [
        ("namespace", namespace.to_string()),
        ("pod", name.to_string()),
        ("netns", r.netns.display().to_string()),
        ("mode", r.mode.to_string()),
    ]
}

/// A pod's connection counters by `decision` label; none when its backend keeps no counters.
fn decisions(pod: &PodStatus) -> Vec<(&'static str, u64)> {
    let Some(c) = &pod.counters else {
        return Vec::new();
    };
    vec![
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
    ]
}
