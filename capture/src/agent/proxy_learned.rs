//! Each proxy container the runtime creates, applied to its pod (`proxy_settings`) on a thread of
//! its own, in the order they come: the pod's capture follows its proxy's settings within
//! milliseconds of the container's creation, before its process runs.

use std::{net::IpAddr, sync::mpsc::Receiver, sync::Arc, thread};

use tracing::{debug, info, warn};

use super::{proxy_watch::Learned, Agent};
use crate::{
    config::{PodSpec, Revision},
    proxy_settings::{self, Applied},
    record::{PodRecord, PodSelector},
};

/// Applies what arrives on `learned` until the watcher goes.
pub fn spawn(agent: Arc<Agent>, learned: Receiver<Learned>) -> std::io::Result<()> {
    thread::Builder::new()
        .name("proxy-settings".into())
        .spawn(move || {
            for proxy in learned {
                apply(&agent, &proxy);
            }
        })
        .map(drop)
}

fn apply(agent: &Agent, learned: &Learned) {
    let which = PodSelector::ContainerId(learned.sandbox.clone());
    let spec_of = |record: &PodRecord| spec_of(agent, record);
    let sandbox = &learned.sandbox;
    let container = &learned.config.container_id;
    let took = || learned.seen.elapsed();
    let result = match proxy_settings::apply(&agent.cfg.paths, &which, &learned.config, &spec_of) {
        Ok(Applied::Unchanged) => {
            debug!(%sandbox, %container, "the proxy container's settings are the pod's already");
            "unchanged"
        }
        Ok(Applied::Updated(changes)) => {
            info!(%sandbox, %container, ?changes, took = ?took(), "the pod's capture brought to its proxy container's settings");
            "applied"
        }
        Ok(Applied::Refused(why)) => {
            warn!(%sandbox, %container, %why, "the proxy container's settings are refused: the pod keeps what ADD set up");
            "refused"
        }
        Err(e) => {
            warn!(%sandbox, %container, error = %e, "cannot bring the pod's capture to its proxy container's settings");
            "failed"
        }
    };
    agent.metrics.count_proxy_settings(result);
}

/// What the pod's ADD was set up from, as the node knows it now: its annotations and addresses,
/// its revision's mesh configuration, the agent's flags.
fn spec_of(agent: &Agent, record: &PodRecord) -> Result<PodSpec, String> {
    let revision = Revision::of_pod(&record.annotations);
    let (mesh_config, mesh_source) = match agent.files.mesh_for(&revision)? {
        Some((mesh, source)) => (Some(mesh), Some(source)),
        None => (None, None),
    };
    let cfg = &record.config;
    let pod_ips = cfg
        .pod_ip4
        .map(IpAddr::V4)
        .into_iter()
        .chain(cfg.pod_ip6.map(IpAddr::V6))
        .chain(cfg.other_pod_ips.iter().copied())
        .collect();
    Ok(PodSpec {
        pod_ips,
        annotations: record.annotations.clone(),
        proxy_uids: agent.cfg.proxy_uids.clone(),
        proxy_gids: agent.cfg.proxy_gids.clone(),
        mesh: agent.cfg.mesh.clone(),
        mesh_config,
        mesh_source,
        proxy_container: None,
        defaults: crate::config::Defaults::IstioCni,
    })
}
