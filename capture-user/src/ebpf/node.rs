//! The node's program set: loaded once from the embedded object and pinned, then adopted from
//! the pins by every later `capture` run (and by a restarted agent), never loaded twice. The node
//! record says which build pinned them.

use std::{
    collections::BTreeMap,
    fs,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use aya::maps::{HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, SkStorage, SockHash};
use capture_common::{
    config::{AccelCounters, PodConfig, PodCounters},
    keys::{CidrKey, HandoffKey, ListenerKey, LoopbackKey, PodAddrKey, PortKey},
    layout::{MapId, MAP_LAYOUTS, UNRECORDED_MAPS, UNRECORDED_VERSION},
    state::{OriginalDst, SockState},
};

use super::{
    hooks::{Hook, UnavailableHook, HOOKS, HOOKS_ADDED_SINCE_LISTED},
    loader::{
        adapted_object, build_name, load_hook, object_id, BoxError, KernelFeatures, LoadError,
    },
    sizing::NodeSizing,
    sys,
};
use crate::{config::CaptureConfig, paths::Paths};

/// The maps the node pins, in `capture_common::layout` order.
pub fn map_names() -> impl Iterator<Item = &'static str> {
    MAP_LAYOUTS.iter().map(|l| l.name)
}

/// The maps user space reads and writes.
pub struct Maps {
    pub pod_configs: HashMap<MapData, u64, PodConfig>,
    pub pod_counters: PerCpuHashMap<MapData, u64, PodCounters>,
    pub node_errors: PerCpuArray<MapData, u64>,
    pub port_lists: HashMap<MapData, PortKey, u8>,
    pub cidr_lists: LpmTrie<MapData, CidrKey, u8>,
    pub inbound_pods: HashMap<MapData, PodAddrKey, u64>,
    pub inbound_listeners: SockHash<MapData, ListenerKey>,
    pub handoff: HashMap<MapData, HandoffKey, OriginalDst>,
    pub socket_states: SkStorage<MapData, SockState>,
    /// Absent on a node whose programs come from a build without acceleration.
    pub accel_counters: Option<PerCpuHashMap<MapData, u64, AccelCounters>>,
    /// Absent on a node whose programs come from a build without the stateless redirect.
    pub loopback_dests: Option<HashMap<MapData, LoopbackKey, OriginalDst>>,
    /// Where they are pinned (the listener adopter loads against the pins).
    pub dir: PathBuf,
}

/// The node's programs (as fds, ready to attach) and maps.
pub struct NodePrograms {
    pub programs: Vec<(Hook, OwnedFd)>,
    pub maps: Maps,
    /// Hooks this kernel refused (none of them needed by every pod).
    pub unavailable: Vec<UnavailableHook>,
    /// The build that pinned them.
    pub build: String,
    /// The pods the node's maps are sized for.
    pub sizing: NodeSizing,
}

impl NodePrograms {
    /// The first hook a pod with `cfg` needs that this kernel refused.
    #[must_use]
    pub fn missing_for(&self, cfg: &CaptureConfig) -> Option<&UnavailableHook> {
        self.unavailable
            .iter()
            .find(|u| HOOKS.iter().any(|h| h.hook == u.hook && h.needed_by(cfg)))
    }
}

/// What a load of the node's programs gave.
pub(super) struct Loaded {
    /// The hooks the kernel refused that not every pod needs.
    pub unavailable: Vec<UnavailableHook>,
    pub features: KernelFeatures,
}

/// Loads the embedded object into the kernel and pins every program under `dir`; each map comes
/// from (or is created and pinned at) its path in `map_pins`.
pub(super) fn load_and_pin(
    dir: &Path,
    map_pins: &[(&'static str, PathBuf)],
    sizing: NodeSizing,
) -> Result<Loaded, LoadError> {
    let pin_error = |path: &Path, source: BoxError| LoadError::Pin {
        path: path.to_path_buf(),
        source,
    };
    let programs_dir = dir.join("programs");
    fs::create_dir_all(&programs_dir).map_err(|e| pin_error(&programs_dir, e.into()))?;
    for (_, path) in map_pins {
        if let Some(parent) = path.parent() {
            fs::create_dir_all(parent).map_err(|e| pin_error(parent, e.into()))?;
        }
    }
    let (mut ebpf, features) = adapted_object(map_pins, sizing)?;
    tracing::info!(?features, dir = %dir.display(), "loading the node's programs");
    let mut unavailable = Vec::new();
    for hook in &HOOKS {
        match load_hook(&mut ebpf, hook) {
            Ok(()) => {}
            Err(reason) if hook.dns_only => {
                tracing::warn!(hook = hook.hook, %reason, "the kernel refused a hook; pods that need it fall back");
                unavailable.push(UnavailableHook {
                    hook: hook.hook.into(),
                    reason,
                });
                continue;
            }
            Err(reason) => {
                return Err(LoadError::Rejected {
                    hook: hook.hook,
                    program: hook.program,
                    reason,
                })
            }
        }
        let program = ebpf
            .program_mut(hook.program)
            .ok_or(LoadError::MissingProgram(hook.program))?;
        let path = programs_dir.join(hook.program);
        program.pin(&path).map_err(|e| pin_error(&path, e.into()))?;
    }
    if let Err(reason) = super::accel::load_and_attach(&mut ebpf, &programs_dir) {
        tracing::warn!(%reason, "the kernel refused the acceleration's sk_msg program; no pod is accelerated");
        unavailable.push(UnavailableHook {
            hook: super::accel::HOOK.into(),
            reason,
        });
    }
    Ok(Loaded {
        unavailable,
        features,
    })
}

fn is_unavailable(unavailable: &[UnavailableHook], hook: &Hook) -> bool {
    unavailable.iter().any(|u| u.hook == hook.hook)
}

/// Whether every program and map the record names is pinned: the maps of its own layouts, which
/// an older build's lack this build's newer maps.
fn all_pinned(paths: &Paths, record: &NodeRecord) -> bool {
    record
        .pinned_hooks()
        .all(|h| record.programs_dir(paths).join(h.program).exists())
        && record
            .map_names()
            .iter()
            .all(|m| record.maps_dir(paths).join(m).exists())
}

/// Removes the node's program and map pins, of every build (the kernel frees them once no link
/// uses them).
pub fn unpin_node(paths: &Paths) {
    for dir in [paths.bpffs.join("programs"), paths.bpffs.join("maps")] {
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                let _ = fs::remove_file(e.path());
            }
        }
    }
    let _ = fs::remove_dir_all(paths.builds_dir());
}

pub(super) fn open_map<T>(dir: &Path, map: MapId) -> Result<T, LoadError>
where
    T: TryFrom<Map>,
    <T as TryFrom<Map>>::Error: std::error::Error + Send + Sync + 'static,
{
    let path = dir.join(map.name());
    let adopt = |source: BoxError| LoadError::Adopt {
        path: path.clone(),
        source,
    };
    let data = MapData::from_pin(&path).map_err(|e| adopt(e.into()))?;
    let map = Map::from_map_data(data).map_err(|e| adopt(e.into()))?;
    T::try_from(map).map_err(|e| adopt(e.into()))
}

/// The socket-local storage of the node's programs: what they recorded per socket.
///
/// # Errors
/// No programs on the node, or the map's pin cannot be opened.
pub fn open_socket_states(paths: &Paths) -> Result<SkStorage<MapData, SockState>, LoadError> {
    let record =
        read_node_record(paths).ok_or_else(|| LoadError::NotLoaded(paths.node_record_path()))?;
    open_map(&record.maps_dir(paths), MapId::SocketStates)
}

/// The typed maps pinned in `dir`.
pub(super) fn open_maps(dir: &Path) -> Result<Maps, LoadError> {
    Ok(Maps {
        pod_configs: open_map(dir, MapId::PodConfigs)?,
        pod_counters: open_map(dir, MapId::PodCounters)?,
        node_errors: open_map(dir, MapId::NodeErrors)?,
        port_lists: open_map(dir, MapId::PortLists)?,
        cidr_lists: open_map(dir, MapId::CidrLists)?,
        inbound_pods: open_map(dir, MapId::InboundPods)?,
        inbound_listeners: open_map(dir, MapId::InboundListeners)?,
        handoff: open_map(dir, MapId::Handoff)?,
        socket_states: open_map(dir, MapId::SocketStates)?,
        accel_counters: open_map(dir, MapId::AccelCounters).ok(),
        loopback_dests: open_map(dir, MapId::LoopbackDests).ok(),
        dir: dir.to_path_buf(),
    })
}

/// The programs pinned for `record`, by hook.
pub(super) fn open_programs(
    paths: &Paths,
    record: &NodeRecord,
) -> Result<Vec<(Hook, OwnedFd)>, LoadError> {
    record
        .pinned_hooks()
        .map(|hook| {
            let path = record.programs_dir(paths).join(hook.program);
            sys::obj_get(&path)
                .map(|fd| (*hook, fd))
                .map_err(|e| LoadError::Adopt {
                    path,
                    source: e.into(),
                })
        })
        .collect()
}

/// Opens the pinned programs and maps. Those of another build are opened only if every map has
/// this build's layout (status, detach and the takeover itself read them).
pub fn adopt(paths: &Paths) -> Result<NodePrograms, LoadError> {
    let record =
        read_node_record(paths).ok_or_else(|| LoadError::NotLoaded(paths.node_record_path()))?;
    if let Some(layout) = MAP_LAYOUTS
        .iter()
        .find(|l| record.layout_version(l.name) != l.version)
    {
        return Err(LoadError::OtherBuild {
            node: format!(
                "{} (map {} in layout {})",
                record.build(),
                layout.name,
                record.layout_version(layout.name)
            ),
            this: build_name(),
            pods: crate::record::count_mode(paths, crate::record::Mode::Ebpf).unwrap_or(0),
        });
    }
    Ok(NodePrograms {
        programs: open_programs(paths, &record)?,
        maps: open_maps(&record.maps_dir(paths))?,
        build: record.build(),
        sizing: record.sizing(),
        unavailable: record.unavailable,
    })
}

/// Which build pinned the node's programs, where, and in which map layouts.
#[derive(Clone, Debug, serde::Serialize, serde::Deserialize)]
pub struct NodeRecord {
    pub object_id: String,
    /// Empty in records written before builds were named.
    #[serde(default)]
    pub build: String,
    /// The pins' directory under the bpffs directory; empty for the builds that pinned at its
    /// top (`programs/`, `maps/`).
    #[serde(default)]
    pub pin_dir: String,
    /// Each map's layout version (absent: `UNRECORDED_VERSION`).
    #[serde(default)]
    pub layouts: BTreeMap<String, u32>,
    #[serde(default)]
    pub unavailable: Vec<UnavailableHook>,
    /// The programs its build pinned (absent from records of the builds before the list was
    /// kept: see `HOOKS_ADDED_SINCE_LISTED`).
    #[serde(default)]
    pub programs: Vec<String>,
    /// The pods its maps are sized for (absent from records of the builds before `--max-pods`,
    /// whose maps held `MAX_PODS` pods).
    #[serde(default)]
    pub max_pods: Option<u32>,
    /// What its programs were adapted to (absent from records of the builds before it was kept).
    #[serde(default)]
    pub features: Option<KernelFeatures>,
}

impl NodeRecord {
    /// This build's record, for pins under its own directory.
    pub(super) fn this_build(
        paths: &Paths,
        Loaded {
            unavailable,
            features,
        }: Loaded,
        sizing: NodeSizing,
    ) -> Self {
        let id = object_id();
        Self {
            build: build_name(),
            max_pods: Some(sizing.max_pods),
            pin_dir: paths
                .build_pin_dir(&sizing.pin_dir_name(&id))
                .strip_prefix(&paths.bpffs)
                .expect("under bpffs")
                .display()
                .to_string(),
            object_id: id,
            layouts: MAP_LAYOUTS
                .iter()
                .map(|l| (l.name.to_string(), l.version))
                .collect(),
            programs: HOOKS
                .iter()
                .filter(|h| !is_unavailable(&unavailable, h))
                .map(|h| h.program.to_string())
                .collect(),
            unavailable,
            features: Some(features),
        }
    }

    /// The hooks its build pinned a program for, of those this build knows.
    pub fn pinned_hooks(&self) -> impl Iterator<Item = &'static Hook> + '_ {
        HOOKS.iter().filter(move |h| {
            let listed = if self.programs.is_empty() {
                !HOOKS_ADDED_SINCE_LISTED.contains(&h.program)
            } else {
                self.programs.iter().any(|p| p == h.program)
            };
            listed && !is_unavailable(&self.unavailable, h)
        })
    }

    /// The build's name as status and metrics show it.
    #[must_use]
    pub fn build(&self) -> String {
        if self.build.is_empty() {
            format!(
                "unnamed+{}",
                self.object_id.get(..12).unwrap_or(&self.object_id)
            )
        } else {
            self.build.clone()
        }
    }

    /// The maps its build pinned.
    #[must_use]
    pub fn map_names(&self) -> Vec<String> {
        if self.layouts.is_empty() {
            UNRECORDED_MAPS
                .iter()
                .map(|m| m.name().to_string())
                .collect()
        } else {
            self.layouts.keys().cloned().collect()
        }
    }

    #[must_use]
    pub fn layout_version(&self, map: &str) -> u32 {
        self.layouts.get(map).copied().unwrap_or(UNRECORDED_VERSION)
    }

    #[must_use]
    pub fn programs_dir(&self, paths: &Paths) -> PathBuf {
        paths.bpffs.join(&self.pin_dir).join("programs")
    }

    #[must_use]
    pub fn maps_dir(&self, paths: &Paths) -> PathBuf {
        paths.bpffs.join(&self.pin_dir).join("maps")
    }

    pub(super) fn save(&self, paths: &Paths) -> Result<(), LoadError> {
        let path = paths.node_record_path();
        let json = serde_json::to_string(self).expect("serialisable");
        crate::fsutil::write_atomic(&path, json.as_bytes(), None).map_err(|e| LoadError::Pin {
            path,
            source: e.into(),
        })
    }

    /// The pods the node's maps are sized for.
    #[must_use]
    pub fn sizing(&self) -> NodeSizing {
        NodeSizing {
            max_pods: self.max_pods.unwrap_or(capture_common::layout::MAX_PODS),
        }
    }

    /// Its pin directory, as this record's build and sizing name it.
    #[must_use]
    pub fn pin_dir_path(&self, paths: &Paths) -> PathBuf {
        paths.bpffs.join(&self.pin_dir)
    }

    #[must_use]
    pub fn is_this_build(&self) -> bool {
        self.object_id == object_id()
    }
}

#[must_use]
pub fn read_node_record(paths: &Paths) -> Option<NodeRecord> {
    fs::read_to_string(paths.node_record_path())
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
}

/// Whether pods still use the node's programs: a pod record in ebpf mode, or a pod's links.
pub fn pods_use_programs(paths: &Paths) -> usize {
    let recorded = crate::record::count_mode(paths, crate::record::Mode::Ebpf).unwrap_or(0);
    let linked = fs::read_dir(paths.links_root()).map_or(0, |d| d.flatten().count());
    recorded.max(linked)
}

/// Loads this build's programs afresh, pinned under its own directory, after removing every
/// earlier pin (no pod uses them).
fn load_fresh(paths: &Paths, sizing: NodeSizing) -> Result<NodeRecord, LoadError> {
    unpin_node(paths);
    let dir = paths.build_pin_dir(&sizing.pin_dir_name(&object_id()));
    let map_pins: Vec<(&'static str, PathBuf)> = map_names()
        .map(|name| (name, dir.join("maps").join(name)))
        .collect();
    let loaded = load_and_pin(&dir, &map_pins, sizing).inspect_err(|_| unpin_node(paths))?;
    let record = NodeRecord::this_build(paths, loaded, sizing);
    record.save(paths)?;
    Ok(record)
}

/// Opens the node's programs, loading and pinning them first if this node has none (or only
/// ones from another build that no pod uses). Programs of another build that pods use are taken
/// over only by the agent at its start (`takeover`); here they are an error. The caller holds
/// the node lock.
pub fn open_or_load(paths: &Paths, sizing: NodeSizing) -> Result<NodePrograms, LoadError> {
    match read_node_record(paths) {
        Some(r) if r.is_this_build() && all_pinned(paths, &r) => {}
        Some(r) if all_pinned(paths, &r) && pods_use_programs(paths) > 0 => {
            return Err(LoadError::OtherBuild {
                node: r.build(),
                this: build_name(),
                pods: pods_use_programs(paths),
            });
        }
        _ => {
            load_fresh(paths, sizing)?;
        }
    }
    adopt(paths)
}

/// The node record, loading this build's programs first where no pod uses any (agent start).
pub(super) fn record_or_load(paths: &Paths, sizing: NodeSizing) -> Result<NodeRecord, LoadError> {
    match read_node_record(paths) {
        Some(r) if all_pinned(paths, &r) && (r.is_this_build() || pods_use_programs(paths) > 0) => {
            Ok(r)
        }
        _ => load_fresh(paths, sizing),
    }
}
