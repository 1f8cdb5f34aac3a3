//! Releasing pods: detach and DEL, the retries of releases that failed, and what attaches that
//! died half-way left behind.

use std::path::Path;

use super::{lock, Error, PodSelector};
use crate::{
    any_backend::{AnyBackend, BackendError},
    ebpf::EbpfBackend,
    netns::Netns,
    paths::Paths,
    record::{self, PodRecord},
};

/// Releases a recorded pod. When its backend cannot take everything away, the record stays,
/// saying why, so that `status` reports the pod and the release is tried again.
pub(super) fn release(paths: &Paths, record: &PodRecord) -> Result<(), Error> {
    let released = if let Ok(mut backend) = AnyBackend::existing(paths, record.mode) {
        backend.detach(record).map_err(Error::from)
    } else {
        // No ebpf programs pinned on this node: nothing is left in the kernel but the pod's links.
        let _ = std::fs::remove_dir_all(paths.pod_links_dir(record.netns_cookie));
        Ok(())
    };
    if let Err(e) = released {
        let broken = PodRecord {
            release_failed: Some(e.to_string()),
            ..record.clone()
        };
        if let Err(save) = record::save(paths, &broken) {
            tracing::warn!(error = %save, "recording a failed release");
        }
        return Err(e);
    }
    record::remove(paths, record.netns_cookie)?;
    Ok(())
}

/// A pod whose release was tried again, and how it went.
pub type Retried = (PodRecord, Result<(), Error>);

/// Tries again every release that failed before (see [`release`]); what each gave.
pub fn retry_failed_releases(paths: &Paths) -> Result<Vec<Retried>, Error> {
    if !paths.state_dir.exists() {
        return Ok(Vec::new());
    }
    let _lock = lock(paths)?;
    Ok(record::load_all(paths)?
        .into_iter()
        .filter(|r| r.release_failed.is_some())
        .map(|r| {
            let result = release(paths, &r);
            (r, result)
        })
        .collect())
}

/// Stops capturing a pod and removes everything attach created for it.
pub fn detach(paths: &Paths, netns_path: &Path) -> Result<PodRecord, Error> {
    release_pod(paths, &PodSelector::Netns(netns_path.into()))?
        .ok_or_else(|| Error::NotAttached(netns_path.into()))
}

/// Releases the selected pod if it is captured; `Ok(None)` when it is not (DEL is idempotent).
pub fn release_pod(paths: &Paths, which: &PodSelector) -> Result<Option<PodRecord>, Error> {
    if !paths.state_dir.exists() {
        return Ok(None);
    }
    let _lock = lock(paths)?;
    let Some(record) = record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)? else {
        if let PodSelector::Netns(netns) = which {
            release_unrecorded(paths, netns)?;
        }
        return Ok(None);
    };
    release(paths, &record)?;
    Ok(Some(record))
}

/// Releases what a pod without a readable record may still hold: a record that is damaged
/// (truncated, say), or an ebpf attach that died before its record was written (its links
/// directory). Whatever of the ebpf backend carries the pod's netns cookie goes, then the
/// record. An iptables pod's rules cannot be named without its record; they stay in its netns,
/// which the runtime deletes with the pod.
fn release_unrecorded(paths: &Paths, netns: &Path) -> Result<(), Error> {
    let Some(cookie) = Netns::open(netns)
        .ok()
        .and_then(|n| n.cookie(crate::ebpf::netns_cookie::netns_cookie).ok())
    else {
        return Ok(());
    };
    let record_path = paths.record_path(cookie);
    let damaged = record_path.exists();
    if !damaged && !paths.pod_links_dir(cookie).exists() {
        return Ok(());
    }
    // Adopted, never loaded: programs that are not there hold nothing to release.
    if let Ok(mut ebpf) = EbpfBackend::adopt(paths) {
        ebpf.release_unrecorded(cookie)
            .map_err(BackendError::from)?;
    }
    if damaged {
        tracing::warn!(record = %record_path.display(), "released a pod whose record was damaged");
        record::remove(paths, cookie)?;
    } else {
        tracing::warn!(netns = %netns.display(), "released what an attach that died half-way left");
    }
    Ok(())
}

/// Releases the ebpf state of attaches that died before writing their record and whose pod
/// nobody deleted since (its netns may be gone, so DEL could not name it): the netns cookie
/// of each.
pub fn release_abandoned_attaches(paths: &Paths) -> Result<Vec<u64>, Error> {
    // A look without the lock first: this runs every few seconds and almost always finds none.
    if !paths.state_dir.exists() || abandoned_attaches(paths).is_empty() {
        return Ok(Vec::new());
    }
    let _lock = lock(paths)?;
    let abandoned = abandoned_attaches(paths);
    let Ok(mut ebpf) = EbpfBackend::adopt(paths) else {
        return Ok(Vec::new());
    };
    for cookie in &abandoned {
        ebpf.release_unrecorded(*cookie)
            .map_err(BackendError::from)?;
    }
    Ok(abandoned)
}

/// The netns cookies of ebpf attaches that began and never finished: a links directory without
/// a record (the scratch pod of a running acceleration check aside). Only certain under the
/// node lock, which every attach holds until its record is written.
fn abandoned_attaches(paths: &Paths) -> Vec<u64> {
    let Ok(dirs) = std::fs::read_dir(paths.links_root()) else {
        return Vec::new();
    };
    let checking = crate::accel::check::running_scratch_pod(paths);
    dirs.flatten()
        .filter_map(|d| d.file_name().to_str()?.parse::<u64>().ok())
        .filter(|cookie| !paths.record_path(*cookie).exists() && Some(*cookie) != checking)
        .collect()
}
