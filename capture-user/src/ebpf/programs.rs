//! The node's program set: loaded once from the embedded object and pinned, then adopted from
//! the pins by every later `capture` run (and by a restarted agent), never loaded twice.

use std::{
    fs,
    os::fd::OwnedFd,
    path::{Path, PathBuf},
};

use aya::{
    maps::{HashMap, LpmTrie, Map, MapData, PerCpuArray, PerCpuHashMap, SockHash},
    programs::{Program, ProgramError},
    Ebpf, EbpfLoader,
};
use capture_common::{
    config::{PodConfig, PodCounters},
    keys::{CidrKey, HandoffKey, ListenerKey, PodAddrKey, PortKey},
    state::OriginalDst,
};

use super::sys;
use crate::{config::CaptureConfig, paths::Paths};

/// The kernel programs, built by build.rs from capture-ebpf.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/capture.bpf.o"));

/// What a program is linked to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The pod's cgroup v2 directory.
    Cgroup,
    /// The pod's network namespace.
    Netns,
}

/// One program and the hook it attaches to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    /// The program's name in the object (its function name).
    pub program: &'static str,
    /// `enum bpf_attach_type`.
    pub attach_type: u32,
    /// The hook as people call it.
    pub hook: &'static str,
    pub target: Target,
    /// Only pods with DNS capture need it (UDP hooks run on every datagram).
    pub dns_only: bool,
}

impl Hook {
    /// Whether a pod with `cfg` needs this hook. A kernel without a hook only some pods need
    /// still serves the others with ebpf.
    #[must_use]
    pub fn needed_by(&self, cfg: &CaptureConfig) -> bool {
        !self.dns_only || cfg.dns.is_some()
    }
}

/// A hook the node's kernel refused. Only hooks that some pods can do without may be missing;
/// the others make the whole ebpf backend unusable.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnavailableHook {
    pub hook: String,
    pub reason: String,
}

/// In attach order: everything the proxy needs (creator tracking, the hand-off, the answers,
/// listener registration) is in place before sk_lookup and connect4/6 start steering. Detach runs
/// in reverse, so steering stops first.
pub const HOOKS: [Hook; 12] = [
    Hook {
        program: "capture_sock_create",
        attach_type: 2,
        hook: "cgroup/sock_create",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_sock_ops",
        attach_type: 3,
        hook: "sock_ops",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getsockopt",
        attach_type: 21,
        hook: "cgroup/getsockopt",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getpeername4",
        attach_type: 29,
        hook: "cgroup/getpeername4",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getpeername6",
        attach_type: 30,
        hook: "cgroup/getpeername6",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_recvmsg4",
        attach_type: 19,
        hook: "cgroup/recvmsg4",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_recvmsg6",
        attach_type: 20,
        hook: "cgroup/recvmsg6",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_sk_lookup",
        attach_type: 36,
        hook: "sk_lookup",
        target: Target::Netns,
        dns_only: false,
    },
    Hook {
        program: "capture_sendmsg4",
        attach_type: 14,
        hook: "cgroup/sendmsg4",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_sendmsg6",
        attach_type: 15,
        hook: "cgroup/sendmsg6",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_connect4",
        attach_type: 10,
        hook: "cgroup/connect4",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_connect6",
        attach_type: 11,
        hook: "cgroup/connect6",
        target: Target::Cgroup,
        dns_only: false,
    },
];

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

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("this capture binary was built without kernel programs (CAPTURE_SKIP_EBPF_BUILD=1); rebuild it")]
    NoObject,
    #[error("parsing the embedded BPF object: {0}")]
    Parse(#[source] aya::EbpfError),
    #[error("the object has no program {0}")]
    MissingProgram(&'static str),
    #[error("the kernel rejected {hook} (program {program}): {reason}; capture needs a kernel with BTF and this hook (see README, kernel requirements)")]
    Rejected {
        hook: &'static str,
        program: &'static str,
        reason: String,
    },
    #[error("pinning {path}: {reason}")]
    Pin { path: PathBuf, reason: String },
    #[error("opening pinned {path}: {reason}; if the pins are damaged, run `capture detach` for every pod and remove the directory")]
    Adopt { path: PathBuf, reason: String },
    #[error("the programs pinned under {dir} come from another capture build and {pods} pod(s) still use them; detach those pods (or restart them) before upgrading")]
    StaleBuild { dir: PathBuf, pods: usize },
}

/// Identifies the embedded object, so that pins from another build are recognised.
#[must_use]
pub fn object_id() -> String {
    // FNV-1a: stable across runs and builds, and needs no dependency.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in OBJECT {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    format!("{h:016x}")
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

/// `CAPTURE_REFUSE_HOOKS=cgroup/recvmsg4,…` has capture treat those hooks as refused by the
/// kernel. Every kernel in the matrix has every hook, so this is how the tests reach the
/// per-pod fallback for a missing one.
fn refused_for_testing(hook: &Hook) -> Option<String> {
    let list = std::env::var("CAPTURE_REFUSE_HOOKS").ok()?;
    list.split(',')
        .any(|h| h.trim() == hook.hook)
        .then(|| "refused through CAPTURE_REFUSE_HOOKS".to_string())
}

/// Loads one hook's program, with the refusal summarised in one line.
pub(super) fn load_hook(ebpf: &mut Ebpf, hook: &Hook) -> Result<(), String> {
    if let Some(reason) = refused_for_testing(hook) {
        return Err(reason);
    }
    let program = ebpf
        .program_mut(hook.program)
        .ok_or_else(|| LoadError::MissingProgram(hook.program).to_string())?;
    load_program(hook, program).map_err(|e| summarize(&e))
}

/// How the object was adapted to this kernel: found by loading, not from its version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct KernelFeatures {
    /// sock_ops may ask for the netns cookie (Linux 5.15+). Without it, a listener the proxy
    /// opened before capture was attached is not registered for inbound capture.
    pub sock_ops_netns_cookie: bool,
}

/// The object's `.rodata` switches take their values from here (the loader borrows them).
static ON: u8 = 1;
static OFF: u8 = 0;

fn parse_object(features: KernelFeatures) -> Result<Ebpf, LoadError> {
    if OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    let sock_ops_netns_cookie = if features.sock_ops_netns_cookie {
        &ON
    } else {
        &OFF
    };
    EbpfLoader::new()
        .override_global("SOCK_OPS_NETNS_COOKIE", sock_ops_netns_cookie, true)
        .load(OBJECT)
        .map_err(LoadError::Parse)
}

/// How the object must be adapted to this kernel (loads sock_ops once or twice, nothing else).
pub fn kernel_features() -> Result<KernelFeatures, LoadError> {
    adapted_object().map(|(_, features)| features)
}

/// The object, with sock_ops already loaded: as built where the kernel takes it, else without
/// the calls it refuses.
pub(super) fn adapted_object() -> Result<(Ebpf, KernelFeatures), LoadError> {
    let mut features = KernelFeatures {
        sock_ops_netns_cookie: true,
    };
    let mut ebpf = parse_object(features)?;
    let hook = HOOKS
        .iter()
        .find(|h| h.program == "capture_sock_ops")
        .expect("sock_ops is a hook");
    let program = ebpf
        .program_mut(hook.program)
        .ok_or(LoadError::MissingProgram(hook.program))?;
    if let Err(e) = load_program(hook, program) {
        tracing::debug!("sock_ops with the netns cookie call: {}", summarize(&e));
        features.sock_ops_netns_cookie = false;
        ebpf = parse_object(features)?;
    }
    Ok((ebpf, features))
}

/// Loads a program unless it is loaded already.
fn load_program(hook: &Hook, program: &mut Program) -> Result<(), ProgramError> {
    if program.fd().is_ok() {
        return Ok(());
    }
    match program {
        Program::CgroupSockAddr(p) => p.load(),
        Program::CgroupSock(p) => p.load(),
        Program::SockOps(p) => p.load(),
        Program::CgroupSockopt(p) => p.load(),
        Program::SkLookup(p) => p.load(),
        _ => unreachable!("{} has an unexpected program type", hook.program),
    }
}

/// One line from a load failure: the errno, and the verifier's last complaint (the whole log goes
/// to the debug log).
fn summarize(e: &ProgramError) -> String {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            tracing::debug!("verifier log:\n{log}");
            let complaint = log
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .take_while(|l| !l.starts_with("verification time") && !l.starts_with("processed "))
                .last()
                .unwrap_or("no verifier output");
            format!("{io_error}; verifier: {complaint}")
        }
        other => other.to_string(),
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
        write_atomic(&record_path, record.as_bytes()).map_err(|e| LoadError::Pin {
            path: record_path.clone(),
            reason: e.to_string(),
        })?;
    }
    adopt(paths)
}

/// Writes a file so that readers see the old or the new content, never a torn one.
pub fn write_atomic(path: &Path, data: &[u8]) -> std::io::Result<()> {
    let tmp = path.with_extension("tmp");
    fs::write(&tmp, data)?;
    fs::rename(&tmp, path)
}
