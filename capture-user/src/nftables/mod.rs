//! The nftables backend: the iptables backend's rules as native nftables (`rules.rs`), for nodes
//! whose distribution no longer ships the iptables tools. Istio chose the same shape for its own
//! native nftables mode (`tools/istio-nftables`): `inet` tables named after the iptables tables,
//! written with `nft -f -` as one transaction.
//!
//! The rules are built with the `nftables` crate's typed JSON schema and applied by `nft -j`:
//! nft is the one maintained userspace for `nf_tables` (the netlink encoding of every expression
//! lives in libnftables), a permissively licensed crate models its JSON interface, and an
//! operator debugging a node has nft at hand anyway. A pure-netlink library would drop the
//! binary, but the one that covers tproxy and ct zones (rustables) is GPL-3.0, which the
//! project's Apache-2.0 cannot take, and the others (`nf_tables` 0.1) encode a handful of
//! expressions only.

pub mod apply;
pub mod rules;
pub(crate) mod stmt;

use capture_common::config::PodCounters;

use crate::{
    backend::{Backend, PodTarget},
    config::{CaptureConfig, InterceptionMode},
    iptables::apply::{tproxy_routing, IptablesError},
    record::PodRecord,
};

pub use apply::NftablesError;

/// Istio's rules as nftables tables in the pod's netns.
pub struct NftablesBackend;

#[derive(Debug, thiserror::Error)]
pub enum NftablesBackendError {
    #[error(transparent)]
    Nft(#[from] NftablesError),
    /// TPROXY's policy routing, written with `ip` as for the iptables backend.
    #[error(transparent)]
    Routing(#[from] IptablesError),
}

impl Backend for NftablesBackend {
    type Error = NftablesBackendError;

    fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), Self::Error> {
        apply::apply(pod.netns_path, cfg)?;
        if cfg.interception_mode == InterceptionMode::Tproxy {
            if let Err(e) = tproxy_routing(pod.netns_path, cfg, true) {
                let _ = tproxy_routing(pod.netns_path, cfg, false);
                let _ = apply::remove(pod.netns_path);
                return Err(e.into());
            }
        }
        Ok(())
    }

    fn detach(&mut self, record: &PodRecord) -> Result<(), Self::Error> {
        // A netns that is gone took its tables with it.
        if !crate::paths::on_node(&record.netns).exists() {
            return Ok(());
        }
        if record.config.interception_mode == InterceptionMode::Tproxy {
            let _ = tproxy_routing(&record.netns, &record.config, false);
        }
        Ok(apply::remove(&record.netns)?)
    }

    fn missing(&self, record: &PodRecord) -> Vec<String> {
        apply::missing(&record.netns, &record.config)
    }

    fn counters(&self, _record: &PodRecord) -> Option<PodCounters> {
        None
    }
}
