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
