//! The ebpf backend: the node's programs attached to a pod's cgroup, its config in the maps.

pub mod accel;
mod adopt;
mod adopt_kernel;
pub mod btf_offsets;
pub mod foreign;
pub mod hook_probe;
pub mod hooks;
pub mod limits;
pub mod list_entries;
pub mod loader;
mod migrate;
pub mod netns_cookie;
pub mod node;
pub mod pod_maps;
pub mod sizing;
pub mod sys;
pub mod takeover;
pub mod trace_maps;

use std::{fs, io, os::fd::AsFd as _, path::PathBuf};

pub use adopt::Adopted;
use capture_common::{
    config::{PodCounters, NODE_ERROR_KINDS},
    layout::MAX_PODS,
};
pub use pod_maps::kernel_config;

use self::{
    hooks::{Target, HOOKS},
    node::NodePrograms,
    sizing::NodeSizing,
};
use crate::{
    backend::{Backend, OpenedPod, PodTarget},
    config::CaptureConfig,
    paths::Paths,
    record::PodRecord,
};

#[derive(Debug, thiserror::Error)]
pub enum EbpfError {
    #[error(transparent)]
    Load(#[from] loader::LoadError),
    #[error(transparent)]
    Maps(#[from] pod_maps::PodMapsError),
    #[error("attaching {hook} to {target}: {source}{hint}")]
    Attach {
        hook: &'static str,
        target: String,
        source: io::Error,
        hint: &'static str,
    },
    #[error("this kernel refused {}, which the pod needs ({}); capture it with --mode iptables, or run the agent in --mode auto", .0.hook, .0.reason)]
    MissingHook(hooks::UnavailableHook),
    #[error("the node captures {captured} pods with eBPF already, as many as its maps are sized for (--max-pods {max_pods}); give the agent a --max-pods of at least the kubelet's maxPods (applied at its next start), or capture this pod with --mode iptables (--mode auto does)")]
    NodeFull { captured: usize, max_pods: u32 },
    #[error(transparent)]
    Adopt(#[from] adopt::AdoptError),
    #[error("taking the node lock {path}: {source}")]
    Lock {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("pinning the {hook} link at {path}: {source}")]
    PinLink {
        hook: &'static str,
        path: PathBuf,
        source: io::Error,
    },
    /// Some of a pod's link pins could not be removed: their links may still run, so the pod
    /// keeps its config (without it every connect in the pod fails) and its record.
    #[error("releasing the pod: its links {} stay ({reason}); its config stays with them, and the release is tried again", .pins.iter().map(|p| p.display().to_string()).collect::<Vec<_>>().join(", "))]
    LinksLeft { pins: Vec<PathBuf>, reason: String },
}

pub struct EbpfBackend {
    paths: Paths,
    node: NodePrograms,
}

impl EbpfBackend {
    /// Opens (or first loads, with maps for `sizing`) the node's programs. The caller holds the
    /// node lock.
    pub fn open(paths: &Paths, sizing: NodeSizing) -> Result<Self, EbpfError> {
        let node = node::open_or_load(paths, sizing)?;
        Ok(Self {
            paths: paths.clone(),
            node,
        })
    }

    /// Opens the node's programs only if they are already pinned (never loads): for read-only
    /// callers and for detach.
    pub fn adopt(paths: &Paths) -> Result<Self, EbpfError> {
        Ok(Self {
            paths: paths.clone(),
            node: node::adopt(paths)?,
        })
    }

    /// Captures one pod. On any failure everything done so far is undone.
    pub fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), EbpfError> {
        if let Some(missing) = self.node.missing_for(cfg) {
            return Err(EbpfError::MissingHook(missing.clone()));
        }
        // Before anything of the pod is written: a pod over its share leaves the node as it was.
        // Checked here only: a takeover or refill writes pods admitted before.
        limits::check(cfg).map_err(pod_maps::PodMapsError::from)?;
        // Leftovers of an attach that died half-way (no record survived it) go first. Only then:
        // the purge walks the node's maps, and attach must not slow down as the node fills up.
        if self.has_leftovers(pod.netns_cookie) {
            self.purge(pod.netns_cookie);
        }
        let result = self.try_attach(pod, cfg).and_then(|()| {
            // With the hooks in place a listener opened from now on registers itself; those that
            // predate them are registered here.
            let adopted = adopt::adopt_listeners(&mut self.node.maps, pod, cfg)?;
            if adopted != Adopted::default() {
                tracing::info!(?adopted, netns = %pod.netns_path.display(), "registered listeners that predate the attach");
            }
            Ok(())
        });
        if result.is_err() {
            self.purge(pod.netns_cookie);
        }
        result.map_err(|e| match e {
            EbpfError::Maps(pod_maps::PodMapsError::NodeFull) => self.node_full(),
            other => other,
        })
    }

    /// Registers the listeners of an attached pod that has none registered: after the listener
    /// map was rebuilt, its proxy's sockets are known to nobody. A pod with registered listeners
    /// keeps them (the kernel registered every later one itself).
    pub fn adopt_listeners_of(&mut self, record: &PodRecord) -> Result<Adopted, EbpfError> {
        if pod_maps::listeners_registered(&self.node.maps, record.netns_cookie) > 0 {
            return Ok(Adopted::default());
        }
        let opened = OpenedPod::of(record).map_err(adopt::AdoptError::Open)?;
        Ok(adopt::adopt_listeners(
            &mut self.node.maps,
            &opened.target(),
            &record.config,
        )?)
    }

    fn try_attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), EbpfError> {
        // The links directory goes first: it marks an attach under way, so that whatever an
        // attach that dies half-way wrote is found again by its cookie (`has_leftovers`,
        // `abandoned_attaches`), even when the pod's retry comes with another address.
        let dir = self.paths.pod_links_dir(pod.netns_cookie);
        fs::create_dir_all(&dir).map_err(|source| EbpfError::PinLink {
            hook: "-",
            path: dir.clone(),
            source,
        })?;
        pod_maps::install(&mut self.node.maps, pod.netns_cookie, cfg)?;
        crate::test_hooks::die_for_testing("after-maps");
        for (hook, prog) in self.node.programs.iter().filter(|(h, _)| h.needed_by(cfg)) {
            let (target, target_name) = match hook.target {
                Target::Cgroup => (
                    pod.cgroup.as_fd(),
                    format!("cgroup {}", pod.cgroup_path.display()),
                ),
                Target::Netns => (
                    pod.netns.as_fd(),
                    format!("netns {}", pod.netns_path.display()),
                ),
            };
            let link = sys::link_create(prog.as_fd(), target, hook.attach_type).map_err(|source| {
                let hint = if source.raw_os_error() == Some(libc::EINVAL) {
                    "; this kernel may lack the hook or bpf links for it (see README, kernel requirements)"
                } else {
                    ""
                };
                EbpfError::Attach { hook: hook.hook, target: target_name.clone(), source, hint }
            })?;
            let path = dir.join(hook.program);
            sys::obj_pin(link.as_fd(), &path).map_err(|source| EbpfError::PinLink {
                hook: hook.hook,
                path,
                source,
            })?;
        }
        Ok(())
    }

    /// The refusal of a pod past the node's pod limit: the per-pod maps have room for exactly
    /// that many pods at their quotas, so one more would take another's room.
    fn node_full(&self) -> EbpfError {
        let captured = self.node.maps.pod_configs.keys().count();
        EbpfError::NodeFull {
            captured,
            max_pods: self.node.sizing.max_pods,
        }
    }

    fn has_leftovers(&self, netns_cookie: u64) -> bool {
        self.paths.pod_links_dir(netns_cookie).exists()
            || self.node.maps.pod_configs.get(&netns_cookie, 0).is_ok()
    }

    /// Rewrites an attached pod's entries for `cfg` (same lists, another config): the
    /// acceleration checks switch their scratch pod's acceleration on this way.
    pub fn reconfigure(&mut self, netns_cookie: u64, cfg: &CaptureConfig) -> Result<(), EbpfError> {
        Ok(pod_maps::install(&mut self.node.maps, netns_cookie, cfg)?)
    }

    /// Rewrites an attached pod's entries from `old`'s to `new`'s: the config and lists `new`
    /// names, then what only `old` named goes.
    pub fn reconfigure_from(
        &mut self,
        netns_cookie: u64,
        old: &CaptureConfig,
        new: &CaptureConfig,
    ) -> Result<(), EbpfError> {
        pod_maps::install(&mut self.node.maps, netns_cookie, new)?;
        pod_maps::remove_stale(&mut self.node.maps, netns_cookie, old, new);
        Ok(())
    }

    /// The pod's acceleration counters summed over CPUs.
    #[must_use]
    pub fn accel_counters(
        &self,
        netns_cookie: u64,
    ) -> Option<capture_common::config::AccelCounters> {
        pod_maps::accel_counters(&self.node.maps, netns_cookie)
    }

    /// How many destinations the pod has loopback addresses for (the stateless redirect).
    #[must_use]
    pub fn loopback_destinations(&self, netns_cookie: u64) -> Option<usize> {
        pod_maps::loopback_destinations(&self.node.maps, netns_cookie)
    }

    /// Stops capturing one pod: links go first (rewriting stops), then the map entries.
    pub fn detach(&mut self, netns_cookie: u64) {
        self.purge(netns_cookie);
    }

    /// Removes the pod's links, in reverse attach order so that steering stops first. Each link
    /// is detached before its pin goes: removing a pin releases the link only once bpffs frees
    /// the inode, after an RCU grace period on some kernels, and a pod must be released when
    /// detach returns. A pin that stays is an error: its link may still run (if it could not be
    /// detached either), and the pod's release must be tried again so that nothing leaks.
    fn unlink(&self, netns_cookie: u64) -> Result<(), EbpfError> {
        let dir = self.paths.pod_links_dir(netns_cookie);
        let mut left = Vec::new();
        let mut reason = String::new();
        for hook in HOOKS.iter().rev() {
            let pin = dir.join(hook.program);
            let Ok(link) = sys::obj_get(&pin) else {
                continue;
            };
            if let Err(e) = sys::link_detach(link.as_fd()) {
                tracing::debug!(hook = hook.hook, %e, "link detach failed; the pin's removal releases it");
            }
            if let Err(e) = fs::remove_file(&pin) {
                reason = e.to_string();
                left.push(pin);
            }
        }
        if !left.is_empty() {
            return Err(EbpfError::LinksLeft { pins: left, reason });
        }
        let _ = fs::remove_dir_all(&dir);
        Ok(())
    }

    /// Releases a pod known only by its netns cookie (its record is damaged): its links, then
    /// every map entry carrying the cookie. Entries stay while a link does.
    pub fn release_unrecorded(&mut self, netns_cookie: u64) -> Result<(), EbpfError> {
        self.unlink(netns_cookie)?;
        pod_maps::remove(&mut self.node.maps, netns_cookie);
        Ok(())
    }

    /// Removes the pod's links and every map entry carrying its cookie, whatever its config was
    /// (after a partial attach); idempotent. Walks the node's maps. Entries stay while a link
    /// does.
    fn purge(&mut self, netns_cookie: u64) {
        match self.unlink(netns_cookie) {
            Ok(()) => pod_maps::remove(&mut self.node.maps, netns_cookie),
            Err(e) => tracing::error!(error = %e, "rolling back a partial attach"),
        }
    }

    /// What capture of the pod lacks: hooks whose link pin is gone, its config, and node-wide
    /// entries that no longer lead to it (empty when capture is fully in place).
    #[must_use]
    pub fn missing_parts(&self, netns_cookie: u64, cfg: &CaptureConfig) -> Vec<String> {
        let dir = self.paths.pod_links_dir(netns_cookie);
        // The hooks of the node's build: a pod of another build's node lacks none it runs.
        let mut missing: Vec<String> = self
            .node
            .programs
            .iter()
            .map(|(h, _)| h)
            .filter(|h| h.needed_by(cfg))
            .filter(|h| sys::obj_get(&dir.join(h.program)).is_err())
            .map(|h| h.hook.to_string())
            .collect();
        if self.node.maps.pod_configs.get(&netns_cookie, 0).is_err() {
            missing.push("pod config".into());
        }
        missing.extend(pod_maps::addresses_not_owned(
            &self.node.maps,
            netns_cookie,
            cfg,
        ));
        missing
    }

    /// Which build's programs the pod's links run: the node's build when every link runs the
    /// node's program for its hook.
    #[must_use]
    pub fn program_build(&self, netns_cookie: u64) -> String {
        let dir = self.paths.pod_links_dir(netns_cookie);
        let mut links = 0;
        let mut others = 0;
        for (hook, prog) in &self.node.programs {
            let Ok(link) = sys::obj_get(&dir.join(hook.program)) else {
                continue;
            };
            links += 1;
            let ours = sys::prog_id(prog.as_fd()).ok();
            if sys::link_prog_id(link.as_fd()).ok() != ours {
                others += 1;
            }
        }
        if others == 0 {
            self.node.build.clone()
        } else {
            format!(
                "other: {others} of {links} links run programs not of build {}",
                self.node.build
            )
        }
    }

    #[must_use]
    pub fn counters(&self, netns_cookie: u64) -> Option<PodCounters> {
        pod_maps::counters(&self.node.maps, netns_cookie)
    }

    /// Node-wide kernel error counters, summed over CPUs, in `NodeError` order.
    #[must_use]
    pub fn node_errors(&self) -> Vec<u64> {
        (0..NODE_ERROR_KINDS)
            .map(|i| {
                self.node
                    .maps
                    .node_errors
                    .get(&i, 0)
                    .map_or(0, |v| v.iter().sum())
            })
            .collect()
    }

    /// Entries waiting in the hand-off map (connections established but not yet accepted).
    #[must_use]
    pub fn pending_handoffs(&self) -> usize {
        self.node.maps.handoff.keys().count()
    }
}

/// The sizing the agent's start gives the node: its `--max-pods`, but never fewer pods than the
/// node captures already (they would not fit the new maps): that keeps them all and says so.
fn sizing_at_start(paths: &Paths, record: &node::NodeRecord, wanted: NodeSizing) -> NodeSizing {
    let captured = u32::try_from(node::pods_use_programs(paths)).unwrap_or(u32::MAX);
    if captured <= wanted.max_pods {
        return wanted;
    }
    // This build's maps as they are where they hold them all; else room for exactly these.
    let kept = if record.is_this_build() && record.sizing().max_pods >= captured {
        record.sizing()
    } else {
        NodeSizing {
            max_pods: captured.min(MAX_PODS),
        }
    };
    tracing::warn!(
        max_pods = wanted.max_pods,
        captured,
        sized_for = kept.max_pods,
        "--max-pods is fewer than the pods the node captures: the maps stay sized for all of them"
    );
    kept
}

/// Makes the node's programs this build's, under the node lock (agent start-up): loads them on a
/// node that has none, takes over in place from the build that pinned them, and moves any pod
/// whose links still run another program. Then registers the listeners the maps do not hold.
pub fn adopt_or_load(
    paths: &Paths,
    wanted: NodeSizing,
) -> Result<Option<takeover::Takeover>, EbpfError> {
    let _lock =
        crate::lock::NodeLock::acquire(&paths.lock_path()).map_err(|source| EbpfError::Lock {
            path: paths.lock_path(),
            source,
        })?;
    let record = node::record_or_load(paths, wanted)?;
    let sizing = sizing_at_start(paths, &record, wanted);
    let report = if record.is_this_build() && record.sizing() == sizing {
        let moved = takeover::converge(paths, &record)?;
        if moved > 0 {
            tracing::info!(
                pods = moved,
                "moved pods whose links ran other programs to the node's"
            );
        }
        None
    } else {
        Some(takeover::take_over(paths, &record, sizing)?)
    };
    let mut backend = EbpfBackend::open(paths, sizing)?;
    let records = crate::record::load_all(paths).unwrap_or_else(|e| {
        tracing::warn!(error = %e, "reading the pod records to adopt listeners");
        Vec::new()
    });
    for record in records
        .iter()
        .filter(|r| r.mode == crate::record::Mode::Ebpf && r.netns.exists())
    {
        match backend.adopt_listeners_of(record) {
            Ok(adopted) if adopted != Adopted::default() => {
                tracing::info!(?adopted, netns = %record.netns.display(), "registered listeners the node's maps did not hold");
            }
            Ok(_) => {}
            Err(e) => {
                tracing::warn!(netns = %record.netns.display(), error = %e, "cannot register the pod's listeners; inbound connections are refused until its proxy listens again");
            }
        }
    }
    Ok(report)
}

impl Backend for EbpfBackend {
    type Error = EbpfError;

    fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), EbpfError> {
        EbpfBackend::attach(self, pod, cfg)
    }

    fn detach(&mut self, record: &PodRecord) -> Result<(), EbpfError> {
        self.unlink(record.netns_cookie)?;
        pod_maps::remove_exact(&mut self.node.maps, record.netns_cookie, &record.config);
        Ok(())
    }

    fn missing(&self, record: &PodRecord) -> Vec<String> {
        self.missing_parts(record.netns_cookie, &record.config)
    }

    fn counters(&self, record: &PodRecord) -> Option<PodCounters> {
        EbpfBackend::counters(self, record.netns_cookie)
    }

    fn program_build(&self, record: &PodRecord) -> Option<String> {
        Some(EbpfBackend::program_build(self, record.netns_cookie))
    }
}
