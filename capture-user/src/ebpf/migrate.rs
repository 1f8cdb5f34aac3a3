//! Carrying entries from an old build's map into the new build's during a takeover: live
//! entries copied as they are, counters converted from their layout and added.

use std::{
    os::fd::{AsFd as _, OwnedFd},
    path::Path,
};

use capture_common::layout::{node_error_from, pod_counters_from, Carry, MapId, MapLayout};

use super::{loader::LoadError, sys};

/// What became of one map.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Carried {
    /// The same map, contents and all.
    Kept,
    /// A new map, written from the pod records or the pods' sockets.
    Rebuilt,
    /// A new map, with the old one's entries converted into it.
    Migrated,
    /// A new map starting empty: counters of a layout this build does not know.
    Reset,
}

/// One map of a takeover: the new build's layout, the old build's pin, and what to do.
pub struct MapPlan {
    pub layout: &'static MapLayout,
    /// The pinned map of the old build and its layout version, if it is pinned.
    pub old: Option<(OwnedFd, u32)>,
    pub carried: Carried,
}

/// Copies the entries of a migrated live map that the new one lacks (before the swap, and again
/// after it for what the old programs wrote meanwhile).
pub(super) fn copy_live(plans: &[MapPlan], new_dir: &Path, map: MapId) -> Result<(), LoadError> {
    let Some(plan) = plans.iter().find(|p| p.layout.map == map) else {
        return Ok(());
    };
    let (Carried::Migrated, Some((old, _))) = (plan.carried, plan.old.as_ref()) else {
        return Ok(());
    };
    const NOEXIST: u64 = 1;
    let path = new_dir.join(map.name());
    let new = sys::obj_get(&path).map_err(|e| LoadError::Takeover {
        path: path.clone(),
        source: e.into(),
    })?;
    for_each_entry(old, |key, value| {
        let _ = sys::map_update(new.as_fd(), key, value, NOEXIST);
    })
    .map_err(|e| LoadError::Takeover {
        path,
        source: e.into(),
    })
}

/// Adds the counts of the old counter maps to the new ones, converted from their layout, once
/// no pod runs the old programs.
pub(super) fn add_counters(plans: &[MapPlan], new_dir: &Path) -> Result<(), LoadError> {
    let cpus = aya::util::nr_cpus().map_err(|(_, e)| LoadError::Takeover {
        path: "/sys/devices/system/cpu/possible".into(),
        source: e.into(),
    })?;
    for plan in plans.iter().filter(|p| p.carried == Carried::Migrated) {
        let (Carry::Counters, Some((old, version))) = (plan.layout.carry, plan.old.as_ref()) else {
            continue;
        };
        let path = new_dir.join(plan.layout.name);
        let error = |e: std::io::Error| LoadError::Takeover {
            path: path.clone(),
            source: e.into(),
        };
        let new = sys::obj_get(&path).map_err(error)?;
        let new_size = sys::map_definition(new.as_fd()).map_err(error)?.value_size as usize;
        let old_size = sys::map_definition(old.as_fd()).map_err(error)?.value_size as usize;
        let (old_slot, new_slot) = (old_size.next_multiple_of(8), new_size.next_multiple_of(8));
        for_each_entry(old, |key, old_values| {
            let mut values = vec![0u8; new_slot * cpus];
            if sys::map_lookup(new.as_fd(), key, &mut values).is_err() {
                // The pod is gone from the new map: its counts go with it.
                return;
            }
            for cpu in 0..cpus {
                let from = &old_values[cpu * old_slot..][..old_size];
                let into = &mut values[cpu * new_slot..][..new_size];
                add_converted(plan.layout.map, *version, from, into);
            }
            let _ = sys::map_update(new.as_fd(), key, &values, 0);
        })
        .map_err(error)?;
    }
    Ok(())
}

/// `into += from`, field by field, `from` read in layout `version`.
fn add_converted(map: MapId, version: u32, from: &[u8], into: &mut [u8]) {
    use capture_common::config::PodCounters;
    match map {
        MapId::PodCounters => {
            let (Some(old), Some(new)) = (
                pod_counters_from(version, from),
                pod_counters_from(map.version(), into),
            ) else {
                return;
            };
            let sum: PodCounters = new.plus(&old);
            // SAFETY: PodCounters is repr(C) plain data of exactly `into`'s length.
            let bytes = unsafe {
                std::slice::from_raw_parts((&raw const sum).cast::<u8>(), size_of::<PodCounters>())
            };
            into[..bytes.len()].copy_from_slice(bytes);
        }
        MapId::NodeErrors => {
            if let (Some(old), Some(new)) =
                (node_error_from(version, from), node_error_from(1, into))
            {
                into[..8].copy_from_slice(&(old + new).to_ne_bytes());
            }
        }
        _ => {}
    }
}

/// Calls `f` with each entry of a hash-like map (values of per-CPU maps: one slot per CPU).
fn for_each_entry(map: &OwnedFd, mut f: impl FnMut(&[u8], &[u8])) -> std::io::Result<()> {
    let definition = sys::map_definition(map.as_fd())?;
    let per_cpu = matches!(definition.map_type, 5 | 6 | 10);
    let cpus = if per_cpu {
        aya::util::nr_cpus().map_err(|(_, e)| e)?
    } else {
        1
    };
    let slot = if per_cpu {
        (definition.value_size as usize).next_multiple_of(8)
    } else {
        definition.value_size as usize
    };
    let mut key = vec![0u8; definition.key_size as usize];
    let mut next = key.clone();
    let mut value = vec![0u8; slot * cpus];
    let mut first = true;
    while sys::map_next_key(map.as_fd(), (!first).then_some(&key[..]), &mut next)? {
        first = false;
        std::mem::swap(&mut key, &mut next);
        if sys::map_lookup(map.as_fd(), &key, &mut value).is_ok() {
            f(&key, &value);
        }
    }
    Ok(())
}
