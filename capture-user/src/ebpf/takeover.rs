//! Taking a node over from another capture build, in place: the upgrade and the rollback of a
//! DaemonSet's rolling update.
//!
//! The new build loads its programs next to the running ones (pinned under its own directory),
//! with every map whose layout and definition are unchanged taken as it is, contents and all.
//! The maps that changed are filled before any pod sees them: configs, lists and pod addresses
//! from the pod records, listeners by finding the pods' sockets. Then each link of each pod is
//! pointed at the new program with `BPF_LINK_UPDATE`, which swaps it in one step: no moment
//! without a program, and a connection's state survives because the maps that hold it are the
//! same maps. Counters follow afterwards. The node record changes last; it is what says which
//! build is the node's, so a takeover that dies half-way is done again by the next start.
//!
//! What cannot be carried (the state of connections in flight in a layout this build does not
//! know) stops the takeover before anything changes, and the running programs stay in force.

use std::{
    collections::BTreeSet,
    fs,
    os::fd::{AsFd as _, OwnedFd},
    path::{Path, PathBuf},
};

use capture_common::layout::{node_error_from, pod_counters_from, Carry, MapId, MAP_LAYOUTS};

pub use super::migrate::Carried;

use super::{
    adopt,
    hooks::{Hook, Target},
    loader::{build_name, object_id, object_maps, BoxError, LoadError},
    migrate::{self, MapPlan},
    node::{self, load_and_pin, open_maps, NodeRecord},
    pod_maps,
    sizing::NodeSizing,
    sys::{self, MapDefinition},
};
use crate::{
    backend::{OpenedPod, PodTarget},
    paths::Paths,
    record::{self, Mode, PodRecord},
};

/// What a takeover did.
#[derive(Debug, serde::Serialize)]
pub struct Takeover {
    pub from: String,
    pub to: String,
    pub maps: Vec<(&'static str, Carried)>,
    /// Pods whose every link now runs this build's programs.
    pub pods: usize,
    /// Pods some link of which could not be moved (they keep the old build's program there).
    pub failed: Vec<String>,
}

/// `max_entries` is the map's capacity at the node's sizing, which the loader sets.
fn same_definition(pinned: &MapDefinition, ours: &aya_obj::Map, max_entries: u32) -> bool {
    pinned.map_type == ours.map_type()
        && pinned.key_size == ours.key_size()
        && pinned.value_size == ours.value_size()
        && pinned.max_entries == max_entries
        && pinned.map_flags == ours.map_flags()
}

/// Whether this build reads counters written in `version` of `map`.
fn counters_readable(map: MapId, version: u32) -> bool {
    let probe = [0u8; 128];
    match map {
        MapId::PodCounters => pod_counters_from(version, &probe).is_some(),
        MapId::NodeErrors => node_error_from(version, &probe).is_some(),
        _ => false,
    }
}

/// The maps the pods' programs run with, by name: the state of open connections is in those,
/// whichever build's pins are recorded (a build from before takeovers, rolled back to, pins
/// maps of its own that the running pods never used).
fn maps_in_use(paths: &Paths, pods: &[PodRecord]) -> Vec<(String, OwnedFd)> {
    let mut found: Vec<(String, OwnedFd)> = Vec::new();
    let Some(pod) = pods
        .iter()
        .find(|p| paths.pod_links_dir(p.netns_cookie).exists())
    else {
        return found;
    };
    let links = fs::read_dir(paths.pod_links_dir(pod.netns_cookie));
    for entry in links.into_iter().flatten().flatten() {
        let Ok(link) = sys::obj_get(&entry.path()) else {
            continue;
        };
        let Ok(prog) = sys::link_prog_id(link.as_fd()).and_then(sys::prog_by_id) else {
            continue;
        };
        for id in sys::prog_map_ids(prog.as_fd()).unwrap_or_default() {
            if let Ok((map, name)) = sys::map_by_id(id) {
                if !found.iter().any(|(n, _)| *n == name) {
                    found.push((name, map));
                }
            }
        }
    }
    found
}

/// The node's ebpf pods, as their records say.
fn ebpf_pods(paths: &Paths) -> Result<Vec<PodRecord>, record::RecordError> {
    Ok(record::load_all(paths)?
        .into_iter()
        .filter(|r| r.mode == Mode::Ebpf)
        .collect())
}

/// Decides each map's fate; an error if some map cannot be carried (nothing has changed then).
/// The live state comes from the maps the pods run with (`in_use`), the rest from the pins.
fn plan(
    paths: &Paths,
    from: &NodeRecord,
    mut in_use: Vec<(String, OwnedFd)>,
    sizing: NodeSizing,
) -> Result<Vec<MapPlan>, LoadError> {
    let ours = object_maps()?;
    MAP_LAYOUTS
        .iter()
        .map(|layout| {
            let definition = ours
                .get(layout.name)
                .ok_or(LoadError::MissingMap(layout.name))?;
            let version = from.layout_version(layout.name);
            let running = (layout.carry == Carry::Live)
                .then(|| {
                    in_use
                        .iter()
                        .position(|(n, _)| n == layout.map.kernel_name())
                        .map(|i| in_use.swap_remove(i).1)
                })
                .flatten();
            let old = running
                .or_else(|| sys::obj_get(&from.maps_dir(paths).join(layout.name)).ok());
            let pinned = old
                .as_ref()
                .and_then(|fd| sys::map_definition(fd.as_fd()).ok());
            let carried = match pinned {
                // Gone (a damaged node): the old programs hold it; nothing can be read from it.
                None => Carried::Rebuilt,
                Some(p)
                    if version == layout.version
                        && same_definition(
                            &p,
                            definition,
                            sizing
                                .capacity(layout.map)
                                .unwrap_or_else(|| definition.max_entries()),
                        ) =>
                {
                    Carried::Kept
                }
                Some(p) => match layout.carry {
                    Carry::FromRecords | Carry::FromSockets => Carried::Rebuilt,
                    Carry::Counters if counters_readable(layout.map, version) => Carried::Migrated,
                    Carry::Counters => Carried::Reset,
                    Carry::Live if version > layout.version => {
                        return Err(LoadError::NewerLayout {
                            map: layout.name,
                            pinned: version,
                            known: layout.version,
                            node: from.build(),
                            this: build_name(),
                        })
                    }
                    // Same entries, another capacity: copied as they are.
                    Carry::Live
                        if version == layout.version
                            && p.map_type == definition.map_type()
                            && p.key_size == definition.key_size()
                            && p.value_size == definition.value_size()
                            && p.map_type != BPF_MAP_TYPE_SK_STORAGE =>
                    {
                        Carried::Migrated
                    }
                    Carry::Live => {
                        return Err(LoadError::CannotCarry {
                            map: layout.name,
                            node: from.build(),
                            this: build_name(),
                            reason: format!(
                                "its layout v{version} ({} byte values) differs from this build's v{} ({} byte values), and the state of open connections it holds has no conversion",
                                p.value_size,
                                layout.version,
                                definition.value_size()
                            ),
                        })
                    }
                },
            };
            Ok(MapPlan {
                layout,
                old: old.map(|fd| (fd, version)),
                carried,
            })
        })
        .collect()
}

const BPF_MAP_TYPE_SK_STORAGE: u32 =
    aya_obj::generated::bpf_map_type::BPF_MAP_TYPE_SK_STORAGE as u32;

/// Takes the node over from the build that `from` names. The caller holds the node lock.
pub fn take_over(
    paths: &Paths,
    from: &NodeRecord,
    sizing: NodeSizing,
) -> Result<Takeover, LoadError> {
    let takeover_error = |path: &Path, source: BoxError| LoadError::Takeover {
        path: path.to_path_buf(),
        source,
    };
    let pods = ebpf_pods(paths).map_err(|e| takeover_error(&paths.records_dir(), e.into()))?;
    let plans = plan(paths, from, maps_in_use(paths, &pods), sizing)?;
    tracing::info!(from = %from.build(), to = %build_name(), max_pods = sizing.max_pods, "taking the node over");
    let dir = paths.build_pin_dir(&sizing.pin_dir_name(&object_id()));
    // A takeover by this build that died half-way left pins here; its pods are moved again.
    let _ = fs::remove_dir_all(&dir);
    // Kept maps are pinned under the new directory first, where the loader finds and uses them;
    // the others are created there.
    let maps_dir = dir.join("maps");
    fs::create_dir_all(&maps_dir).map_err(|e| takeover_error(&maps_dir, e.into()))?;
    for p in plans.iter().filter(|p| p.carried == Carried::Kept) {
        let (fd, _) = p.old.as_ref().expect("kept maps are open");
        let path = maps_dir.join(p.layout.name);
        sys::obj_pin(fd.as_fd(), &path).map_err(|e| takeover_error(&path, e.into()))?;
    }
    let map_pins: Vec<(&'static str, PathBuf)> = plans
        .iter()
        .map(|p| (p.layout.name, maps_dir.join(p.layout.name)))
        .collect();
    let loaded = load_and_pin(&dir, &map_pins, sizing)?;
    let to = NodeRecord::this_build(paths, loaded, sizing);
    let mut maps = open_maps(&to.maps_dir(paths))?;
    let programs = node::open_programs(paths, &to)?;
    let carried = |map: MapId| {
        plans
            .iter()
            .find(|p| p.layout.map == map)
            .map(|p| p.carried)
    };
    let listeners_rebuilt = carried(MapId::InboundListeners) != Some(Carried::Kept);

    // Before the swap: everything the new programs read. Kept maps are written too: a build
    // from before takeovers existed, rolled back to, loads maps of its own that lack the pods it
    // did not attach, and the writes are the same values for every pod it did.
    let mut seen_listeners: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); pods.len()];
    // A pod whose entries cannot be written stays on the old programs, which keep the old maps.
    let mut failed = Vec::new();
    let mut stays = BTreeSet::new();
    for (pod, seen) in pods.iter().zip(seen_listeners.iter_mut()) {
        if let Err(e) = pod_maps::install(&mut maps, pod.netns_cookie, &pod.config) {
            tracing::error!(netns = %pod.netns.display(), error = %e, "writing the pod's entries into the new maps; it stays on the old programs");
            failed.push(format!("{}: {e}", pod.netns.display()));
            stays.insert(pod.netns_cookie);
            continue;
        }
        if listeners_rebuilt {
            adopt_pod_listeners(&mut maps, pod, seen);
        }
    }
    for live in [MapId::Handoff, MapId::LoopbackDests] {
        migrate::copy_live(&plans, &to.maps_dir(paths), live)?;
    }

    for pod in &pods {
        if stays.contains(&pod.netns_cookie) {
            continue;
        }
        if let Err(e) = move_pod(paths, pod, &programs) {
            tracing::error!(netns = %pod.netns.display(), error = %e, "moving the pod's links to the new programs");
            failed.push(format!("{}: {e}", pod.netns.display()));
        }
    }

    // After the swap: what the old programs wrote meanwhile.
    if listeners_rebuilt {
        for (pod, seen) in pods.iter().zip(seen_listeners.iter_mut()) {
            adopt_pod_listeners(&mut maps, pod, seen);
        }
    }
    for live in [MapId::Handoff, MapId::LoopbackDests] {
        migrate::copy_live(&plans, &to.maps_dir(paths), live)?;
    }
    migrate::add_counters(&plans, &to.maps_dir(paths))?;

    to.save(paths)?;
    remove_pins_of(paths, from, &to);
    let report = Takeover {
        from: from.build(),
        to: to.build(),
        maps: plans.iter().map(|p| (p.layout.name, p.carried)).collect(),
        pods: pods.len() - failed.len(),
        failed,
    };
    tracing::info!(?report, "took the node over");
    Ok(report)
}

/// Registers the pod's listeners not yet in `seen` with the new listener map.
fn adopt_pod_listeners(maps: &mut node::Maps, pod: &PodRecord, seen: &mut BTreeSet<u64>) {
    let result = with_target(pod, |target| {
        adopt::adopt_listeners_except(maps, target, &pod.config, seen).map_err(|e| e.to_string())
    });
    if let Err(e) = result {
        tracing::warn!(netns = %pod.netns.display(), error = %e, "registering the pod's listeners with the new map");
    }
}

/// Runs `f` with the pod's netns and cgroup opened.
fn with_target<T>(
    pod: &PodRecord,
    f: impl FnOnce(&PodTarget<'_>) -> Result<T, String>,
) -> Result<T, String> {
    let opened = OpenedPod::of(pod).map_err(|e| e.to_string())?;
    f(&opened.target())
}

/// Points each of the pod's links at this build's program for its hook, creates the links this
/// build needs that the pod lacks, and removes those of hooks this build does not run for it.
pub(super) fn move_pod(
    paths: &Paths,
    pod: &PodRecord,
    programs: &[(Hook, OwnedFd)],
) -> Result<usize, String> {
    let dir = paths.pod_links_dir(pod.netns_cookie);
    let mut moved = 0;
    let mut wanted = BTreeSet::new();
    for (hook, prog) in programs.iter().filter(|(h, _)| h.needed_by(&pod.config)) {
        wanted.insert(hook.program);
        let pin = dir.join(hook.program);
        if let Ok(link) = sys::obj_get(&pin) {
            let runs = sys::link_prog_id(link.as_fd()).map_err(|e| e.to_string())?;
            if runs == sys::prog_id(prog.as_fd()).map_err(|e| e.to_string())? {
                continue;
            }
            sys::link_update(link.as_fd(), prog.as_fd(), None)
                .map_err(|e| format!("updating the {} link: {e}", hook.hook))?;
        } else {
            fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
            with_target(pod, |target| {
                let on = match hook.target {
                    Target::Cgroup => target.cgroup.as_fd(),
                    Target::Netns => target.netns.as_fd(),
                };
                let link = sys::link_create(prog.as_fd(), on, hook.attach_type)
                    .map_err(|e| format!("linking {}: {e}", hook.hook))?;
                sys::obj_pin(link.as_fd(), &pin)
                    .map_err(|e| format!("pinning {}: {e}", pin.display()))
            })?;
        }
        moved += 1;
    }
    for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = entry.file_name();
        if wanted.iter().any(|w| name == *w) {
            continue;
        }
        if let Ok(link) = sys::obj_get(&entry.path()) {
            let _ = sys::link_detach(link.as_fd());
        }
        let _ = fs::remove_file(entry.path());
        moved += 1;
    }
    Ok(moved)
}

/// Removes the old build's pins once nothing needs them (its programs and the maps only they
/// used are freed with the last link), and any other build's leftovers.
fn remove_pins_of(paths: &Paths, from: &NodeRecord, to: &NodeRecord) {
    if from.pin_dir.is_empty() {
        for dir in [from.programs_dir(paths), from.maps_dir(paths)] {
            for entry in fs::read_dir(&dir).into_iter().flatten().flatten() {
                let _ = fs::remove_file(entry.path());
            }
            let _ = fs::remove_dir(&dir);
        }
    }
    let ours = to.pin_dir_path(paths);
    for entry in fs::read_dir(paths.builds_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        if entry.path() != ours {
            let _ = fs::remove_dir_all(entry.path());
        }
    }
}

/// Which builds a node has met, for `capture doctor`: this binary's, the node's, and what this
/// build's agent would do with each map if it started now.
#[derive(Debug, serde::Serialize)]
pub struct Builds {
    pub this: String,
    pub node: Option<String>,
    /// The pods the node's maps are sized for.
    pub max_pods: Option<u32>,
    /// Pods using the node's programs.
    pub pods: usize,
    /// What a takeover by this build would do with each map (none when the node is this
    /// build's or has no programs), or why it would stop.
    pub takeover: Option<Result<Vec<(&'static str, Carried)>, String>>,
}

/// Looks, changes nothing.
#[must_use]
pub fn preview(paths: &Paths, sizing: NodeSizing) -> Builds {
    let record = node::read_node_record(paths);
    let takeover = record.as_ref().filter(|r| !r.is_this_build()).map(|r| {
        let pods = ebpf_pods(paths).unwrap_or_default();
        plan(paths, r, maps_in_use(paths, &pods), sizing)
            .map(|plans| plans.iter().map(|p| (p.layout.name, p.carried)).collect())
            .map_err(|e| e.to_string())
    });
    Builds {
        this: build_name(),
        max_pods: record.as_ref().map(|r| r.sizing().max_pods),
        node: record.map(|r| r.build()),
        pods: node::pods_use_programs(paths),
        takeover,
    }
}

/// Moves the links of pods that do not run this build's programs (a takeover that died after
/// moving some of them, before the record said so). The caller holds the node lock.
pub fn converge(paths: &Paths, record: &NodeRecord) -> Result<usize, LoadError> {
    let programs = node::open_programs(paths, record)?;
    let mut maps = open_maps(&record.maps_dir(paths))?;
    let pods = ebpf_pods(paths).map_err(|e| LoadError::Takeover {
        path: paths.records_dir(),
        source: e.into(),
    })?;
    let mut moved = 0;
    for pod in pods.iter().filter(|r| r.netns.exists()) {
        // The node's maps lack the pod (its pins were lost and loaded afresh): its entries first,
        // or the programs it is moved to would refuse its connections.
        if maps.pod_configs.get(&pod.netns_cookie, 0).is_err() {
            if let Err(e) = pod_maps::install(&mut maps, pod.netns_cookie, &pod.config) {
                tracing::error!(netns = %pod.netns.display(), error = %e, "writing the pod's entries into the node's maps; its links stay as they are");
                continue;
            }
            tracing::warn!(netns = %pod.netns.display(), "the node's maps lacked the pod; its entries are written again");
        }
        match move_pod(paths, pod, &programs) {
            Ok(0) => {}
            Ok(_) => moved += 1,
            Err(e) => {
                tracing::warn!(netns = %pod.netns.display(), error = %e, "moving the pod's links to the node's programs");
            }
        }
    }
    Ok(moved)
}
