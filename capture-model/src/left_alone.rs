//! Pods that Istio's injector marked but capture leaves alone, as istio-cni does (an istio-init
//! pod, whose own rules redirect it; a gateway; a pod without an istio-proxy container;
//! `Skip::left_alone_reason` says which). capture-cni tells the agent about each one; the agent counts them and keeps one file per pod in the state
//! directory, so that `capture status` lists them until the pod's DEL (or GC, or its netns
//! vanishing) ends them.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use crate::{
    fsutil::{container_file_name, write_atomic},
    paths::Paths,
    record::PodRef,
};

/// Why a pod Istio injected is not captured: a metric's label.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Reason {
    /// Istio's istio-init container redirects the pod with its own rules.
    IstioInit,
    /// The proxy is a router (a gateway), not a sidecar.
    Gateway,
    /// The injector added no istio-proxy container.
    NoProxyContainer,
    /// `sidecar.istio.io/inject` is false.
    InjectionDisabled,
    /// The pod's namespace is excluded in capture-cni's configuration.
    ExcludedNamespace,
}

impl Reason {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::IstioInit => "istio_init",
            Self::Gateway => "gateway",
            Self::NoProxyContainer => "no_proxy_container",
            Self::InjectionDisabled => "injection_disabled",
            Self::ExcludedNamespace => "excluded_namespace",
        }
    }
}

/// One pod left alone, as capture-cni reports it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeftAlone {
    pub pod: PodRef,
    pub netns: Option<PathBuf>,
    pub reason: Reason,
    /// The reason in words.
    pub detail: String,
    /// When the agent heard of it.
    #[serde(default)]
    pub reported_at_unix: u64,
}

fn file(paths: &Paths, container_id: &str) -> PathBuf {
    paths
        .left_alone_dir()
        .join(format!("{}.json", container_file_name(container_id)))
}

/// Keeps the report (replacing an earlier one for the same container).
pub fn save(paths: &Paths, report: &LeftAlone) -> io::Result<()> {
    fs::create_dir_all(paths.left_alone_dir())?;
    let data = serde_json::to_vec_pretty(report).map_err(io::Error::other)?;
    write_atomic(&file(paths, &report.pod.container_id), &data, None)
}

/// Ends the container's report, if it has one.
pub fn forget(paths: &Paths, container_id: &str) -> io::Result<()> {
    match fs::remove_file(file(paths, container_id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Every report kept, in container-id order; one that cannot be read is skipped (it is only a
/// report: nothing of the pod's capture depends on it).
#[must_use]
pub fn list(paths: &Paths) -> Vec<LeftAlone> {
    let Ok(entries) = fs::read_dir(paths.left_alone_dir()) else {
        return Vec::new();
    };
    let mut reports: Vec<LeftAlone> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|x| x == "json"))
        .filter_map(|p| serde_json::from_slice(&fs::read(p).ok()?).ok())
        .collect();
    reports.sort_by(|a, b| a.pod.container_id.cmp(&b.pod.container_id));
    reports
}

/// Ends the reports `keep` turns down; how many it ended.
pub fn retain(paths: &Paths, keep: impl Fn(&LeftAlone) -> bool) -> usize {
    list(paths)
        .iter()
        .filter(|r| !keep(r))
        .filter(|r| forget(paths, &r.pod.container_id).is_ok())
        .count()
}

/// Does the report's pod still have its network namespace? A runtime removes the netns when it
/// removes the sandbox, so a report whose netns is gone missed its DEL.
#[must_use]
pub fn netns_exists(report: &LeftAlone) -> bool {
    report.netns.as_deref().is_none_or(Path::exists)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_are_kept_listed_and_ended() {
        let dir = std::env::temp_dir().join(format!("capture-left-alone-{}", std::process::id()));
        let paths = Paths::new(dir.join("bpf"), &dir);
        let report = |id: &str, netns: &str| LeftAlone {
            pod: PodRef {
                namespace: "ns".into(),
                name: format!("pod-{id}"),
                uid: "u".into(),
                container_id: id.into(),
            },
            netns: Some(netns.into()),
            reason: Reason::IstioInit,
            detail: "istio-init".into(),
            reported_at_unix: 1,
        };
        save(&paths, &report("b", "/")).unwrap();
        save(&paths, &report("a", "/nonexistent-netns")).unwrap();
        save(&paths, &report("../x", "/")).unwrap();
        let ids = |v: Vec<LeftAlone>| -> Vec<String> {
            v.into_iter().map(|r| r.pod.container_id).collect()
        };
        assert_eq!(ids(list(&paths)), ["../x", "a", "b"]);
        assert_eq!(retain(&paths, netns_exists), 1);
        forget(&paths, "b").unwrap();
        forget(&paths, "never-reported").unwrap();
        assert_eq!(ids(list(&paths)), ["../x"]);
        fs::remove_dir_all(&dir).unwrap();
    }
}
