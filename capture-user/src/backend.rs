//! One interface for both ways of capturing a pod. `ops` (and so the CLI, and later the agent and
//! the CNI plugin) drive a `dyn Backend` and never branch on the mode themselves.

use std::{fs::File, path::Path};

use capture_common::config::PodCounters;

use crate::{
    config::CaptureConfig,
    ebpf::{EbpfBackend, EbpfError},
    iptables::{apply::IptablesError, IptablesBackend},
    paths::Paths,
    record::{Mode, PodRecord},
};

/// Everything a backend may need to capture one pod.
pub struct PodTarget<'a> {
    pub netns_cookie: u64,
    pub netns_path: &'a Path,
    pub netns: &'a File,
    pub cgroup_path: &'a Path,
    pub cgroup: &'a File,
}

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Ebpf(#[from] EbpfError),
    #[error(transparent)]
    Iptables(#[from] IptablesError),
}

pub trait Backend {
    /// Captures the pod. On failure nothing of the attempt remains.
    fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), BackendError>;
    /// Removes everything `attach` created for the pod; succeeds when nothing is left to remove.
    fn detach(&mut self, record: &PodRecord) -> Result<(), BackendError>;
    /// What is missing for capture to be in force for the pod (empty when it is).
    fn missing(&self, record: &PodRecord) -> Vec<String>;
    /// The pod's counters, where the backend keeps any.
    fn counters(&self, record: &PodRecord) -> Option<PodCounters>;
}

/// The backend for `mode`, ready to attach: the ebpf one loads the node's programs if this node
/// has none yet.
pub fn for_attach(paths: &Paths, mode: Mode) -> Result<Box<dyn Backend>, BackendError> {
    Ok(match mode {
        Mode::Ebpf => Box::new(EbpfBackend::open(paths)?),
        Mode::Iptables => Box::new(IptablesBackend),
    })
}

/// The backend for `mode` as already present on the node, never loading anything.
pub fn existing(paths: &Paths, mode: Mode) -> Result<Box<dyn Backend>, BackendError> {
    Ok(match mode {
        Mode::Ebpf => Box::new(EbpfBackend::adopt(paths)?),
        Mode::Iptables => Box::new(IptablesBackend),
    })
}

/// The node's existing backends, each opened at most once (for read-only passes over many pods).
pub struct ExistingBackends<'p> {
    paths: &'p Paths,
    opened: Vec<(Mode, Option<Box<dyn Backend>>)>,
}

impl<'p> ExistingBackends<'p> {
    #[must_use]
    pub fn new(paths: &'p Paths) -> Self {
        Self {
            paths,
            opened: Vec::new(),
        }
    }

    /// The backend for `mode`, or `None` if it is not present on this node.
    pub fn get(&mut self, mode: Mode) -> Option<&dyn Backend> {
        let i = match self.opened.iter().position(|(m, _)| *m == mode) {
            Some(i) => i,
            None => {
                self.opened.push((mode, existing(self.paths, mode).ok()));
                self.opened.len() - 1
            }
        };
        self.opened[i].1.as_deref()
    }
}
