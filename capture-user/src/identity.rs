//! Proxy identity by container at run time: the proxy container's cgroup named at attach, and
//! learned later (the agent from the runtime, or `capture proxy-container`), written to the
//! pod's record and to its kernel config under the node lock.

use std::path::PathBuf;

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

/// What the caller says of a pod's proxy container.
#[derive(Clone, Debug)]
pub enum Naming {
    /// Its cgroup (a directory below the pod's), and the runtime's container id if known.
    Cgroup {
        path: PathBuf,
        container_id: Option<String>,
    },
    /// The pod has none: every container is captured.
    None,
    /// Forget it: the proxy's connections are refused until it is named again.
    Unknown,
}

/// Names the selected pod's proxy container (or says it has none, or forgets it): the record
/// first, then the kernel config, so that a failure in between leaves a record the next write
/// repeats and a kernel that still refuses rather than exempts.
///
/// # Errors
/// The pod is not captured, not under proxy identity by container, on iptables, or the cgroup
/// is not the pod's; or its maps cannot be written.
pub fn set_proxy_container(
    paths: &Paths,
    which: &PodSelector,
    naming: Naming,
) -> Result<Learned, Error> {
    let _lock = ops::lock(paths)?;
    let Some(mut record) = record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)?
    else {
        return Err(Error::Identity(format!(
            "{which:?} is not captured (no record in the state directory)"
        )));
    };
    let proxy = match naming {
        Naming::Cgroup { path, container_id } => {
            proxy_identity::known_cgroup(&record.cgroup, &path, container_id)?
        }
        Naming::None => ProxyContainer::None,
        Naming::Unknown => ProxyContainer::Unknown,
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
    if record.mode != Mode::Ebpf {
        return Err(Error::Identity(proxy_identity::IPTABLES_CANNOT.into()));
    }
    identity.proxy = proxy;
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
