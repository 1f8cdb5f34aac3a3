//! The node's program set: loaded once from the embedded object and pinned, then adopted from
//! the pins by every later `capture` run (and by a restarted agent), never loaded twice. The node
//! record says which build pinned them.

use std::{fs, os::fd::OwnedFd};

use aya::maps::{HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, SkStorage, SockHash};
use capture_common::{
    config::{PodConfig, PodCounters},
    keys::{CidrKey, HandoffKey, ListenerKey, PodAddrKey, PortKey},
    state::{OriginalDst, SockState},
};

use super::{
    hooks::{Hook, UnavailableHook, HOOKS},
    loader::{adapted_object, load_hook, object_id, LoadError},
    sys,
};
use crate::{config::CaptureConfig, paths::Paths};

const MAP_NAMES: [&str; 9] = [
    "POD_CONFIGS",
    "POD_COUNTERS",
    "NODE_ERRORS",
    "PORT_LISTS",
    "CIDR_LISTS",
    "INBOUND_PODS",
    "INBOUND_LISTENERS",
    "HANDOFF",
    "SOCKET_STATES",
];

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
}

/// The node's programs (as fds, ready to attach) and maps.
pub struct NodePrograms {
    pub programs: Vec<(Hook, OwnedFd)>,
    pub maps: Maps,
    /// Hooks this kernel refused (none of them needed by every pod).
    pub unavailable: Vec<UnavailableHook>,
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

/// Loads the embedded object into the kernel and pins every program and map; returns the hooks
/// the kernel refused that not every pod needs.
fn load_and_pin(paths: &Paths) -> Result<Vec<UnavailableHook>, LoadError> {
    let (mut ebpf, features) = adapted_object()?;
    tracing::info!(?features, "loading the node's programs");
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
        let path = paths.programs_dir().join(hook.program);
        program.pin(&path).map_err(|e| LoadError::Pin {
            path,
            reason: e.to_string(),
        })?;
    }
    for name in MAP_NAMES {
        let map = ebpf.map(name).ok_or(LoadError::MissingProgram(name))?;
        let path = paths.maps_dir().join(name);
        map.pin(&path).map_err(|e| LoadError::Pin {
            path,
            reason: e.to_string(),
        })?;
    }
    Ok(unavailable)
}

fn is_unavailable(unavailable: &[UnavailableHook], hook: &Hook) -> bool {
    unavailable.iter().any(|u| u.hook == hook.hook)
}

fn all_pinned(paths: &Paths, unavailable: &[UnavailableHook]) -> bool {
    HOOKS
        .iter()
        .filter(|h| !is_unavailable(unavailable, h))
        .all(|h| paths.programs_dir().join(h.program).exists())
        && MAP_NAMES.iter().all(|m| paths.maps_dir().join(m).exists())
}

/// Removes the node's program and map pins (the kernel frees them once no link uses them).
pub fn unpin_node(paths: &Paths) {
    for dir in [paths.programs_dir(), paths.maps_dir()] {
        if let Ok(entries) = fs::read_dir(&dir) {
            for e in entries.flatten() {
                let _ = fs::remove_file(e.path());
            }
        }
    }
}

fn open_map<T>(paths: &Paths, name: &str) -> Result<T, LoadError>
where
    T: TryFrom<Map>,
    <T as TryFrom<Map>>::Error: std::fmt::Display,
{
    let path = paths.maps_dir().join(name);
    let adopt = |e: String| LoadError::Adopt {
        path: path.clone(),
        reason: e,
    };
    let data = MapData::from_pin(&path).map_err(|e| adopt(e.to_string()))?;
    let map = Map::from_map_data(data).map_err(|e| adopt(e.to_string()))?;
    T::try_from(map).map_err(|e| adopt(e.to_string()))
}

pub fn adopt(paths: &Paths) -> Result<NodePrograms, LoadError> {
    let unavailable = read_node_record(paths)
        .map(|r| r.unavailable)
        .unwrap_or_default();
    let programs = HOOKS
        .iter()
        .filter(|hook| !is_unavailable(&unavailable, hook))
        .map(|hook| {
            let path = paths.programs_dir().join(hook.program);
            sys::obj_get(&path)
                .map(|fd| (*hook, fd))
                .map_err(|e| LoadError::Adopt {
                    path,
                    reason: e.to_string(),
                })
        })
        .collect::<Result<_, _>>()?;
    let maps = Maps {
        pod_configs: open_map(paths, "POD_CONFIGS")?,
        pod_counters: open_map(paths, "POD_COUNTERS")?,
        node_errors: open_map(paths, "NODE_ERRORS")?,
        port_lists: open_map(paths, "PORT_LISTS")?,
        cidr_lists: open_map(paths, "CIDR_LISTS")?,
        inbound_pods: open_map(paths, "INBOUND_PODS")?,
        inbound_listeners: open_map(paths, "INBOUND_LISTENERS")?,
        handoff: open_map(paths, "HANDOFF")?,
        socket_states: open_map(paths, "SOCKET_STATES")?,
    };
    Ok(NodePrograms {
        programs,
        maps,
        unavailable,
    })
}

#[derive(serde::Serialize, serde::Deserialize)]
struct NodeRecord {
    object_id: String,
    #[serde(default)]
    unavailable: Vec<UnavailableHook>,
}

fn read_node_record(paths: &Paths) -> Option<NodeRecord> {
    fs::read_to_string(paths.node_record_path())
        .ok()
        .and_then(|s| serde_json::from_str(&s).ok())
}

/// Opens the node's programs, loading and pinning them first if this node has none (or only
/// unused ones from another build). The caller holds the node lock.
pub fn open_or_load(paths: &Paths) -> Result<NodePrograms, LoadError> {
    let id = object_id();
    let record_path = paths.node_record_path();
    let pinned = read_node_record(paths);
    let current = pinned
        .as_ref()
        .is_some_and(|r| r.object_id == id && all_pinned(paths, &r.unavailable));
    if !current {
        let refused_then = pinned.as_ref().map_or(&[][..], |r| &r.unavailable[..]);
        if all_pinned(paths, refused_then) {
            let pods = crate::record::count_mode(paths, crate::record::Mode::Ebpf).unwrap_or(0);
            if pods > 0 {
                return Err(LoadError::StaleBuild {
                    dir: paths.bpffs.clone(),
                    pods,
                });
            }
        }
        unpin_node(paths);
        let unavailable = match load_and_pin(paths) {
            Ok(unavailable) => unavailable,
            Err(e) => {
                unpin_node(paths);
                return Err(e);
            }
        };
        let record = serde_json::to_string(&NodeRecord {
            object_id: id,
            unavailable,
        })
        .expect("serialisable");
        crate::fsutil::write_atomic(&record_path, record.as_bytes(), None).map_err(|e| {
            LoadError::Pin {
                path: record_path.clone(),
                reason: e.to_string(),
            }
        })?;
    }
    adopt(paths)
}
