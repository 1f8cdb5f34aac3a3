//! The iptables backend: Istio's own rules (parity-spec.md section B), generated from the same validated
//! configuration as the ebpf backend. It is the reference for the parity tests, the fallback for
//! kernels that lack a hook, and the baseline for benchmarks.

pub mod apply;
pub mod flavour;
pub mod rules;

use capture_common::config::PodCounters;

use crate::{
    backend::{Backend, PodTarget},
    config::CaptureConfig,
    record::PodRecord,
};

/// Istio's rules, written into the pod's netns with the node's iptables variant (`flavour`); a
/// captured pod's record says which variant wrote its rules, and they are removed and checked
/// with that one.
pub struct IptablesBackend {
    pub flavour: flavour::Flavour,
}

impl Backend for IptablesBackend {
    type Error = apply::IptablesError;

    fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), Self::Error> {
        apply::apply(pod.netns_path, cfg, self.flavour)
    }

    fn detach(&mut self, record: &PodRecord) -> Result<(), Self::Error> {
        // A netns that is gone took its rules with it.
        if !crate::paths::on_node(&record.netns).exists() {
            return Ok(());
        }
        apply::remove(&record.netns, &record.config, record.iptables_flavour())
    }

    fn missing(&self, record: &PodRecord) -> Vec<String> {
        apply::missing(&record.netns, &record.config, record.iptables_flavour())
    }

    fn counters(&self, _record: &PodRecord) -> Option<PodCounters> {
        None
    }
}
