//! Pod records: what was attached where, kept in the state directory so that `detach`,
//! `status` and a restarted agent find every captured pod.

use std::{
    collections::BTreeMap,
    fs, io,
    path::PathBuf,
    time::{SystemTime, UNIX_EPOCH},
};

use serde::{Deserialize, Serialize};

use crate::{
    config::{CaptureConfig, FallbackCause},
    fsutil::write_atomic,
    netns::{CookieFallback, Netns},
    paths::Paths,
};

/// How a pod is captured.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Kernel programs on the pod's cgroup.
    Ebpf,
    /// Istio's nat rules in the pod's netns (the reference and fallback).
    Iptables,
    /// The same rules as native nftables tables, for nodes without the iptables tools.
    Nftables,
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Ebpf => "ebpf",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
        })
    }
}

/// Who a pod is in Kubernetes, when capture was asked for by the CNI plugin.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRef {
    pub namespace: String,
    pub name: String,
    pub uid: String,
    /// The sandbox (infra) container id the runtime names the attachment by.
    pub container_id: String,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PodRecord {
    pub netns_cookie: u64,
    pub netns: PathBuf,
    pub cgroup: PathBuf,
    pub mode: Mode,
    pub annotations: BTreeMap<String, String>,
    pub config: CaptureConfig,
    pub attached_at_unix: u64,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod: Option<PodRef>,
    /// Why this pod runs on iptables although the node's mode is ebpf (auto mode), in words.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_reason: Option<String>,
    /// The same as one of a few causes; `None` in records from builds before it was kept.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_cause: Option<FallbackCause>,
    /// Why the last release of the pod failed, when it did: the pod keeps its record and config
    /// until a later release (the runtime's DEL again, or the agent's retry) succeeds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub release_failed: Option<String>,
    /// The iptables variant the pod's rules were written with (iptables pods); `None` in records
    /// from builds before the choice, which wrote with the unsuffixed names.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub iptables: Option<crate::flavour::Flavour>,
    /// The settings more than one place decides (annotation, mesh, flag), and where each came
    /// from; empty in records from builds before they were kept.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub settings: Vec<crate::config::Setting>,
    /// The pod's proxy container as the runtime created it, once the agent learned it; the
    /// pod's settings were brought to it (`proxy_settings`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_container: Option<crate::config::ProxyContainerConfig>,
    /// Why the proxy container's settings were not applied (a variable that is no boolean): the
    /// pod keeps what ADD set up.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub proxy_settings_refused: Option<String>,
}

impl PodRecord {
    /// `NAMESPACE/NAME` where the record knows the pod, else its netns path.
    #[must_use]
    pub fn display_name(&self) -> String {
        self.pod.as_ref().map_or_else(
            || self.netns.display().to_string(),
            |p| format!("{}/{}", p.namespace, p.name),
        )
    }

    /// The iptables variant to remove or check the pod's rules with.
    #[must_use]
    pub fn iptables_flavour(&self) -> crate::flavour::Flavour {
        self.iptables.unwrap_or_default()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum RecordError {
    #[error("pod record {path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("pod record {path} is damaged ({source}); remove it after checking `capture status`")]
    Parse {
        path: PathBuf,
        source: serde_json::Error,
    },
}

#[must_use]
pub fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// A record as it is written to disk.
#[must_use]
pub fn encode(record: &PodRecord) -> Vec<u8> {
    serde_json::to_vec_pretty(record).expect("records serialise")
}

/// A record as it is read back from disk (records of earlier builds included).
pub fn decode(data: &[u8]) -> Result<PodRecord, serde_json::Error> {
    serde_json::from_slice(data)
}

pub fn save(paths: &Paths, record: &PodRecord) -> Result<(), RecordError> {
    let path = paths.record_path(record.netns_cookie);
    write_atomic(&path, &encode(record), None)
        .map_err(|source| RecordError::Io { path, source })?;
    if let Some(pod) = &record.pod {
        // Only a shortcut: `find` checks what it points at, and scans without it.
        let _ = index_container(paths, &pod.container_id, record.netns_cookie);
    }
    Ok(())
}

fn index_container(paths: &Paths, container_id: &str, netns_cookie: u64) -> io::Result<()> {
    fs::create_dir_all(paths.container_index_dir())?;
    write_atomic(
        &paths.container_index_path(container_id),
        netns_cookie.to_string().as_bytes(),
        None,
    )
}

/// The netns cookie the container index names for `container_id`, if any.
fn indexed_cookie(paths: &Paths, container_id: &str) -> Option<u64> {
    fs::read_to_string(paths.container_index_path(container_id))
        .ok()?
        .trim()
        .parse()
        .ok()
}

/// Removes the container index's entries whose record is gone: a build from before the index
/// (rolled back to) removes records without their entries. Returns how many went.
pub fn prune_container_index(paths: &Paths) -> usize {
    let mut pruned = 0;
    for entry in fs::read_dir(paths.container_index_dir())
        .into_iter()
        .flatten()
        .flatten()
    {
        let path = entry.path();
        let names_a_record = fs::read_to_string(&path)
            .ok()
            .and_then(|c| c.trim().parse::<u64>().ok())
            .is_some_and(|cookie| paths.record_path(cookie).exists());
        // write_atomic's temporaries start with a dot, and one may be on its way.
        let temporary = entry.file_name().to_string_lossy().starts_with('.');
        if !names_a_record && !temporary && fs::remove_file(&path).is_ok() {
            pruned += 1;
        }
    }
    pruned
}

pub fn remove(paths: &Paths, netns_cookie: u64) -> Result<(), RecordError> {
    // The index entry goes with the record it points at (a newer one for the same container
    // points elsewhere and stays).
    if let Ok(Some(PodRecord { pod: Some(pod), .. })) = load(paths, netns_cookie) {
        if indexed_cookie(paths, &pod.container_id) == Some(netns_cookie) {
            let _ = fs::remove_file(paths.container_index_path(&pod.container_id));
        }
    }
    let path = paths.record_path(netns_cookie);
    match fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(RecordError::Io { path, source: e }),
        _ => Ok(()),
    }
}

/// One pod's record, if it has one.
pub fn load(paths: &Paths, netns_cookie: u64) -> Result<Option<PodRecord>, RecordError> {
    let path = paths.record_path(netns_cookie);
    match fs::read(&path) {
        Ok(data) => decode(&data)
            .map(Some)
            .map_err(|source| RecordError::Parse { path, source }),
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(RecordError::Io { path, source }),
    }
}

/// How many pods use `mode` (reads every record: for the rare callers that need it).
pub fn count_mode(paths: &Paths, mode: Mode) -> Result<usize, RecordError> {
    Ok(load_all(paths)?.iter().filter(|r| r.mode == mode).count())
}

/// A record that cannot be read back (truncated, damaged): its pod is left out of everything
/// that reads records, so that the node goes on with the others, and reported.
#[derive(Clone, Debug, Serialize)]
pub struct DamagedRecord {
    pub path: PathBuf,
    pub error: String,
}

/// The state directory's records: those that read back, oldest first, and those that do not.
#[derive(Debug, Default)]
pub struct Scan {
    pub records: Vec<PodRecord>,
    pub damaged: Vec<DamagedRecord>,
}

/// Reads every record; fails only when the directory itself cannot be listed.
pub fn scan(paths: &Paths) -> Result<Scan, RecordError> {
    let dir = paths.records_dir();
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Scan::default()),
        Err(source) => return Err(RecordError::Io { path: dir, source }),
    };
    let mut scan = Scan::default();
    for entry in entries {
        let path = entry
            .map_err(|source| RecordError::Io {
                path: dir.clone(),
                source,
            })?
            .path();
        if path.extension().is_none_or(|e| e != "json") {
            continue;
        }
        let read = fs::read(&path)
            .map_err(|e| e.to_string())
            .and_then(|data| decode(&data).map_err(|e| e.to_string()));
        match read {
            Ok(record) => scan.records.push(record),
            Err(error) => scan.damaged.push(DamagedRecord { path, error }),
        }
    }
    scan.records
        .sort_by_key(|r: &PodRecord| (r.attached_at_unix, r.netns_cookie));
    Ok(scan)
}

/// Every pod record that reads back, oldest first (`scan` names the others).
pub fn load_all(paths: &Paths) -> Result<Vec<PodRecord>, RecordError> {
    Ok(scan(paths)?.records)
}

/// How a caller names a captured pod.
#[derive(Clone, Debug)]
pub enum PodSelector {
    /// By netns: its cookie while the netns exists, else the path it was attached with (the
    /// netns may be gone by the time the pod is released).
    Netns(PathBuf),
    /// By the runtime's container id (CNI DEL, CHECK, GC).
    ContainerId(String),
    /// By `NAMESPACE/NAME`, for pods captured through the CNI plugin (their record knows it).
    Name { namespace: String, name: String },
}

impl std::fmt::Display for PodSelector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Netns(p) => write!(f, "netns {}", p.display()),
            Self::ContainerId(id) => write!(f, "container {id}"),
            Self::Name { namespace, name } => write!(f, "pod {namespace}/{name}"),
        }
    }
}

/// The record of the pod `which` names, if the node has one.
///
/// # Errors
/// The records cannot be read.
pub fn find(
    paths: &Paths,
    which: &PodSelector,
    cookie_fallback: CookieFallback,
) -> Result<Option<PodRecord>, RecordError> {
    // One record where the selector names its file: a DEL on a node of a thousand pods must
    // not read them all.
    let named = |r: &PodRecord| selected(r, which);
    match which {
        PodSelector::ContainerId(id) => {
            if let Some(Ok(Some(r))) = indexed_cookie(paths, id).map(|c| load(paths, c)) {
                if named(&r) {
                    return Ok(Some(r));
                }
            }
        }
        PodSelector::Netns(path) => {
            let cookie = Netns::open(path)
                .ok()
                .and_then(|n| n.cookie(cookie_fallback).ok());
            if let Some(c) = cookie {
                // The file named by the cookie is the only record that can hold it.
                return match load(paths, c) {
                    Ok(found) => Ok(found.filter(|r| r.netns_cookie == c)),
                    Err(_) => Ok(load_all(paths)?.into_iter().find(|r| r.netns_cookie == c)),
                };
            }
        }
        PodSelector::Name { .. } => {}
    }
    Ok(load_all(paths)?.into_iter().find(named))
}

/// Whether `r` is the record `which` names, its netns taken as gone (compared by path).
fn selected(r: &PodRecord, which: &PodSelector) -> bool {
    match which {
        PodSelector::Netns(path) => r.netns == *path,
        PodSelector::ContainerId(id) => r.pod.as_ref().is_some_and(|p| p.container_id == *id),
        PodSelector::Name { namespace, name } => r
            .pod
            .as_ref()
            .is_some_and(|p| p.namespace == *namespace && p.name == *name),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seed(name: &str) -> PodRecord {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../fuzz/corpus/record")
            .join(name);
        decode(&fs::read(&path).unwrap()).unwrap()
    }

    fn no_cookie(_: &fs::File) -> io::Result<u64> {
        Err(io::Error::other("not asked"))
    }

    /// CNI DEL names a pod by its container: the index leads to its record alone, an entry that
    /// points at another pod's record is not believed, and records without an entry (written by
    /// earlier builds) are still found by reading them all.
    #[test]
    fn a_container_finds_its_record_through_the_index_or_without_it() {
        let dir = std::env::temp_dir().join(format!("capture-record-index-{}", std::process::id()));
        let paths = Paths::new(dir.join("bpffs"), dir.join("state"));
        fs::create_dir_all(paths.records_dir()).unwrap();
        let pod = |cookie: u64, id: &str| {
            let mut r = seed("ebpf-cni.json");
            r.netns_cookie = cookie;
            r.pod.as_mut().expect("the seed has a pod").container_id = id.into();
            r
        };
        let (a, b) = (pod(1, "a"), pod(2, "b"));
        save(&paths, &a).unwrap();
        save(&paths, &b).unwrap();
        let by = |id: &str| {
            find(&paths, &PodSelector::ContainerId(id.into()), no_cookie)
                .unwrap()
                .map(|r| r.netns_cookie)
        };
        assert_eq!((indexed_cookie(&paths, "a"), by("a")), (Some(1), Some(1)));
        assert_eq!(by("b"), Some(2));

        index_container(&paths, "a", 2).unwrap();
        assert_eq!(by("a"), Some(1), "an entry naming b's record");
        fs::remove_dir_all(paths.container_index_dir()).unwrap();
        assert_eq!((by("a"), by("b")), (Some(1), Some(2)), "no index at all");

        save(&paths, &a).unwrap();
        save(&paths, &b).unwrap();
        remove(&paths, 1).unwrap();
        assert_eq!((indexed_cookie(&paths, "a"), by("a")), (None, None));
        // A new pod of the same container id keeps its entry when the old record goes.
        save(&paths, &pod(3, "b")).unwrap();
        remove(&paths, 2).unwrap();
        assert_eq!((indexed_cookie(&paths, "b"), by("b")), (Some(3), Some(3)));
        // An entry whose record went without it (an earlier build's DEL) is pruned.
        index_container(&paths, "gone", 4).unwrap();
        assert_eq!(prune_container_index(&paths), 1);
        assert_eq!(indexed_cookie(&paths, "gone"), None);
        assert_eq!(indexed_cookie(&paths, "b"), Some(3));
        fs::remove_dir_all(&dir).unwrap();
    }

    /// The fuzz seeds are records as this build writes them (or as earlier builds did): a change
    /// of the format that they no longer follow would leave the fuzzer starting from nothing.
    #[test]
    fn the_fuzz_seeds_are_records() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/record");
        let mut seen = 0;
        for entry in fs::read_dir(&dir).unwrap() {
            let path = entry.unwrap().path();
            let record = decode(&fs::read(&path).unwrap())
                .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            assert_eq!(decode(&encode(&record)).unwrap(), record);
            seen += 1;
        }
        assert!(seen >= 3, "{} holds {seen} seeds", dir.display());
    }
}
