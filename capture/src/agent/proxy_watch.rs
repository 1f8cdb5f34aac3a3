//! Learns each injected pod's proxy container. The runtime makes a container's cgroup below the
//! pod's when it creates the container's task (runc create), before the container's process
//! runs; the agent watches the pod's cgroup directory (inotify), asks the runtime over CRI which
//! container a new directory belongs to and what it was created with, and when it is the proxy:
//! under proxy identity by container, writes its cgroup to the pod's kernel config; for every
//! injected pod, hands its environment and ids to the agent, which brings the pod's capture to
//! them (`proxy_settings`). A restarted proxy is a new container with a new cgroup: it is
//! learned the same way, and the old cgroup exempts nothing any more.
//!
//! Works alike for every CRI runtime (containerd, CRI-O) and cgroup driver (cgroupfs, systemd):
//! the directory's name carries the container id. Should the proxy's process run before the
//! agent has written its cgroup, its connections that need the exemption are refused (the kernel
//! side's `PROXY_CONTAINER_UNKNOWN`) and its retry goes through.

use std::{
    collections::HashMap,
    ffi::OsStr,
    io,
    path::{Path, PathBuf},
    sync::{mpsc::Sender, Arc, Mutex, PoisonError},
    time::Instant,
};

use nix::{
    errno::Errno,
    sys::inotify::{AddWatchFlags, InitFlags, Inotify, WatchDescriptor},
};
use tracing::{debug, error, info, warn};

use crate::{
    cni::selection::{sidecar_status, Status},
    config::{ProxyContainer, ProxyContainerConfig},
    identity::Naming,
    paths::Paths,
    record::{PodRecord, PodSelector},
    runtime::cri::{Cri, CALL_TIMEOUT},
};

pub struct ProxyWatch {
    paths: Paths,
    cri: Cri,
    runtime: tokio::runtime::Handle,
    inotify: Inotify,
    watched: Mutex<HashMap<WatchDescriptor, Watched>>,
    /// The proxy container's name in pods not under proxy identity by container.
    proxy_container: String,
    /// Where each proxy container learned goes (the agent, which applies its settings).
    learned: Mutex<Sender<Learned>>,
}

/// A pod's proxy container, as the runtime created it.
#[derive(Clone, Debug)]
pub struct Learned {
    /// The sandbox id its pod's record is found by.
    pub sandbox: String,
    pub config: ProxyContainerConfig,
    /// When its cgroup appeared (or was found), for the time it took to apply.
    pub seen: Instant,
}

/// A pod whose proxy container is looked for.
#[derive(Clone, Debug)]
struct Watched {
    /// The sandbox id its record is found by.
    sandbox: String,
    pod_uid: String,
    cgroup: PathBuf,
    /// The proxy container's name in the pod spec.
    container: String,
    /// Under proxy identity by container: its cgroup is written to the pod's kernel config.
    by_container: bool,
}

/// The container id a cgroup directory's name carries: `<id>` (cgroupfs), `cri-containerd-<id>.scope`,
/// `crio-<id>.scope` (systemd). CRI-O's monitor (`crio-conmon-<id>`) shares the id but is not the
/// container.
fn container_id_of(dir: &str) -> Option<&str> {
    if dir.contains("conmon") {
        return None;
    }
    let stem = dir.strip_suffix(".scope").unwrap_or(dir);
    let id = stem.rsplit('-').next()?;
    (id.len() == 64 && id.bytes().all(|b| b.is_ascii_hexdigit())).then_some(id)
}

impl ProxyWatch {
    /// Starts the watcher's thread. Call from inside the agent's async runtime.
    ///
    /// # Errors
    /// No inotify instance, or no thread.
    pub fn start(
        paths: Paths,
        cri_socket: &Path,
        proxy_container: String,
        learned: Sender<Learned>,
    ) -> io::Result<Arc<Self>> {
        let cri = Cri::new(cri_socket, CALL_TIMEOUT).map_err(io::Error::other)?;
        let watch = Arc::new(Self {
            paths,
            cri,
            runtime: tokio::runtime::Handle::current(),
            inotify: Inotify::init(InitFlags::IN_CLOEXEC)?,
            watched: Mutex::new(HashMap::new()),
            proxy_container,
            learned: Mutex::new(learned),
        });
        let reader = Arc::clone(&watch);
        std::thread::Builder::new()
            .name("proxy-watch".into())
            .spawn(move || reader.read_events())?;
        Ok(watch)
    }

    /// Watches a captured pod's cgroup for its containers, and looks at those it has already (a
    /// pod captured in place, an agent restarted): a pod the runtime set up through capture-cni
    /// whose sidecar the injector added, or one under proxy identity by container.
    pub fn watch(&self, record: &PodRecord) {
        let Some(pod) = &record.pod else {
            return;
        };
        let identity = record
            .config
            .proxy_identity
            .as_ref()
            .filter(|i| i.proxy != ProxyContainer::None);
        if identity.is_none() && sidecar_status(&record.annotations) == Status::Absent {
            return;
        }
        let watched = Watched {
            sandbox: pod.container_id.clone(),
            pod_uid: pod.uid.clone(),
            cgroup: record.cgroup.clone(),
            container: identity
                .map_or_else(|| self.proxy_container.clone(), |i| i.container.clone()),
            by_container: identity.is_some(),
        };
        let flags = AddWatchFlags::IN_CREATE | AddWatchFlags::IN_ONLYDIR;
        match self.inotify.add_watch(&record.cgroup, flags) {
            Ok(wd) => {
                self.watched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .insert(wd, watched.clone());
            }
            Err(e) => {
                let consequence = if watched.by_container {
                    "its proxy's connections stay refused"
                } else {
                    "the pod keeps the settings ADD gave it"
                };
                warn!(cgroup = %record.cgroup.display(), error = %e, consequence, "cannot watch the pod's cgroup for its proxy container");
                return;
            }
        }
        if let Ok(entries) = std::fs::read_dir(&record.cgroup) {
            for entry in entries.flatten() {
                if entry.file_type().is_ok_and(|t| t.is_dir()) {
                    self.consider(&watched, &entry.file_name(), false);
                }
            }
        }
    }

    fn read_events(&self) {
        loop {
            let events = match self.inotify.read_events() {
                Ok(events) => events,
                Err(Errno::EINTR) => continue,
                Err(e) => {
                    error!(error = %e, "reading the pods' cgroup events failed: proxy containers are learned no more");
                    return;
                }
            };
            for event in events {
                if event.mask.contains(AddWatchFlags::IN_IGNORED) {
                    self.watched
                        .lock()
                        .unwrap_or_else(PoisonError::into_inner)
                        .remove(&event.wd);
                    continue;
                }
                if !event
                    .mask
                    .contains(AddWatchFlags::IN_CREATE | AddWatchFlags::IN_ISDIR)
                {
                    continue;
                }
                let watched = self
                    .watched
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .get(&event.wd)
                    .cloned();
                if let (Some(watched), Some(name)) = (watched, event.name) {
                    self.consider(&watched, &name, true);
                }
            }
        }
    }

    /// A container cgroup of a watched pod: is it the proxy's? `created`: it just appeared (a
    /// directory found by the first look may be a stopped container's).
    fn consider(&self, watched: &Watched, dir: &OsStr, created: bool) {
        let start = Instant::now();
        let Some(id) = dir.to_str().and_then(container_id_of) else {
            return;
        };
        let container = match self.runtime.block_on(self.cri.container(id, true)) {
            Ok(Some(c)) => c,
            Ok(None) => {
                debug!(
                    container = id,
                    "a pod cgroup's container the runtime does not know"
                );
                return;
            }
            Err(e) => {
                warn!(container = id, error = %e, "cannot ask the runtime which container made a pod cgroup");
                return;
            }
        };
        if container.name != watched.container
            || container
                .pod_uid
                .as_ref()
                .is_some_and(|uid| *uid != watched.pod_uid)
            || (!created && !container.running)
        {
            return;
        }
        if watched.by_container {
            self.name_proxy_cgroup(watched, dir, id, start);
        }
        if let Some(config) = container.config {
            let learned = Learned {
                sandbox: watched.sandbox.clone(),
                config,
                seen: start,
            };
            let _ = self
                .learned
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .send(learned);
        }
    }

    fn name_proxy_cgroup(&self, watched: &Watched, dir: &OsStr, id: &str, start: Instant) {
        let which = PodSelector::ContainerId(watched.sandbox.clone());
        let naming = Naming::Cgroup {
            path: watched.cgroup.join(dir),
            container_id: Some(id.into()),
        };
        match crate::identity::set_proxy_container(&self.paths, &which, naming) {
            Ok(learned) if learned.changed => {
                info!(sandbox = %watched.sandbox, container = id, cgroup = %watched.cgroup.join(dir).display(), took = ?start.elapsed(), "proxy container known");
            }
            Ok(_) => {}
            Err(e) => {
                warn!(sandbox = %watched.sandbox, container = id, error = %e, "cannot record the pod's proxy container");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::container_id_of;

    #[test]
    fn container_ids_come_from_every_driver_s_cgroup_names() {
        let id = "0123456789abcdef0123456789abcdef0123456789abcdef0123456789abcdef";
        assert_eq!(container_id_of(id), Some(id));
        assert_eq!(
            container_id_of(&format!("cri-containerd-{id}.scope")),
            Some(id)
        );
        assert_eq!(container_id_of(&format!("crio-{id}.scope")), Some(id));
        assert_eq!(container_id_of(&format!("crio-conmon-{id}.scope")), None);
        assert_eq!(container_id_of("kubepods-burstable.slice"), None);
        assert_eq!(container_id_of(&id[1..]), None);
    }
}
