//! The interface both ways of capturing a pod implement, and what they are given. This module
//! sits below the backends: it names none of them (`any_backend` picks one for a mode).

use std::{fs::File, path::Path};

use capture_common::config::PodCounters;

use crate::{config::CaptureConfig, record::PodRecord};

/// Everything a backend may need to capture one pod.
pub struct PodTarget<'a> {
    pub netns_cookie: u64,
    pub netns_path: &'a Path,
    pub netns: &'a File,
    pub cgroup_path: &'a Path,
    pub cgroup: &'a File,
}

impl<'a> PodTarget<'a> {
    /// The pod of netns cookie `netns_cookie`, its netns and cgroup each as (path, open file).
    #[must_use]
    pub fn new(
        netns_cookie: u64,
        netns: (&'a Path, &'a File),
        cgroup: (&'a Path, &'a File),
    ) -> Self {
        Self {
            netns_cookie,
            netns_path: netns.0,
            netns: netns.1,
            cgroup_path: cgroup.0,
            cgroup: cgroup.1,
        }
    }
}

/// A recorded pod's netns and cgroup, opened, for the backends to act on it again.
pub struct OpenedPod<'r> {
    record: &'r PodRecord,
    netns: crate::netns::Netns,
    cgroup: File,
}

#[derive(Debug, thiserror::Error)]
pub enum OpenPodError {
    #[error(transparent)]
    Netns(#[from] crate::netns::NetnsError),
    #[error("opening the pod's cgroup {path}: {source}")]
    Cgroup {
        path: std::path::PathBuf,
        #[source]
        source: std::io::Error,
    },
}

impl<'r> OpenedPod<'r> {
    pub fn of(record: &'r PodRecord) -> Result<Self, OpenPodError> {
        let netns = crate::netns::Netns::open(&record.netns)?;
        let cgroup = File::open(&record.cgroup).map_err(|source| OpenPodError::Cgroup {
            path: record.cgroup.clone(),
            source,
        })?;
        Ok(Self {
            record,
            netns,
            cgroup,
        })
    }

    #[must_use]
    pub fn target(&self) -> PodTarget<'_> {
        PodTarget::new(
            self.record.netns_cookie,
            (&self.record.netns, self.netns.file()),
            (&self.record.cgroup, &self.cgroup),
        )
    }
}

pub trait Backend {
    type Error: std::error::Error + Send + Sync + 'static;

    /// Captures the pod. On failure nothing of the attempt remains.
    fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), Self::Error>;
    /// Removes everything `attach` created for the pod; succeeds when nothing is left to remove.
    fn detach(&mut self, record: &PodRecord) -> Result<(), Self::Error>;
    /// What is missing for capture to be in force for the pod (empty when it is).
    fn missing(&self, record: &PodRecord) -> Vec<String>;
    /// The pod's counters, where the backend keeps any.
    fn counters(&self, record: &PodRecord) -> Option<PodCounters>;
    /// Which build's kernel programs capture the pod, where it runs any.
    fn program_build(&self, _record: &PodRecord) -> Option<String> {
        None
    }
}
