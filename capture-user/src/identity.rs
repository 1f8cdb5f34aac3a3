//! Proxy identity by container at run time: the proxy container's cgroup named at attach, and
//! learned later (the agent from the runtime, or `capture proxy-container`), written to the
//! pod's record and to its kernel config under the node lock.

use std::path::Path;

use crate::{
    config::{proxy_identity, ProxyContainer},
    ebpf::EbpfBackend,
    ops::{self, Error},
    paths::Paths,
    record::{self, Mode, PodRecord, PodSelector},
};

/// What changed when the proxy container was named.
#[derive(Debug)]
pub struct Learned {
    pub record: PodRecord,
    /// False when the record already said so.
    pub changed: bool,
}

/// Names the selected pod's proxy container (or says it has none, or forgets it): the record
/// first, then the kernel config, so that a failure in between leaves a record the next write
/// repeats and a kernel that still refuses rather than exempts.
///
/// # Errors
/// The pod is not captured, not under proxy identity by container, or its maps cannot be
/// written.
pub fn set_proxy_container(
    paths: &Paths,
    which: &PodSelector,
    proxy: ProxyContainer,
) -> Result<Learned, Error> {
    let _lock = ops::lock(paths)?;
    let Some(mut record) = record::find(paths, which)? else {
        return Err(Error::Identity(format!(
            "{which:?} is not captured (no record in the state directory)"
        )));
    };
    let Some(identity) = record.config.proxy_identity.as_mut() else {
        return Err(Error::Identity(format!(
            "pod netns {} is captured with proxy identity by uid; its proxy container cannot be named (attach it with --proxy-identity container)",
            record.netns.display()
        )));
    };
    if identity.proxy == proxy {
        return Ok(Learned {
            record,
            changed: false,
        });
    }
    identity.proxy = proxy;
    if record.mode != Mode::Ebpf {
        return Err(Error::Identity(proxy_identity::IPTABLES_CANNOT.into()));
    }
    record::save(paths, &record)?;
    let mut ebpf = EbpfBackend::adopt(paths)
        .map_err(|e| Error::Backend(crate::any_backend::BackendError::Ebpf(e)))?;
    ebpf.reconfigure(record.netns_cookie, &record.config)
        .map_err(|e| Error::Backend(crate::any_backend::BackendError::Ebpf(e)))?;
    Ok(Learned {
        record,
        changed: true,
    })
}

/// The proxy container a cgroup names, checked against the pod's cgroup.
///
/// # Errors
/// The cgroup is not a cgroup v2 directory below the pod's.
pub fn known(
    pod_cgroup: &Path,
    proxy_cgroup: &Path,
    container_id: Option<String>,
) -> Result<ProxyContainer, Error> {
    Ok(proxy_identity::known_cgroup(
        pod_cgroup,
        proxy_cgroup,
        container_id,
    )?)
}
