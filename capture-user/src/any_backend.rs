//! The backend of a mode, chosen at run time. `ops` (and so the CLI, the agent and the CNI
//! plugin) drive an `AnyBackend` and never branch on the mode themselves.

use capture_common::config::PodCounters;

use crate::{
    backend::{Backend, PodTarget},
    config::CaptureConfig,
    ebpf::{EbpfBackend, EbpfError},
    iptables::flavour::Flavour,
    iptables::{apply::IptablesError, IptablesBackend},
    nftables::{NftablesBackend, NftablesBackendError},
    node::NodeChoices,
    paths::Paths,
    record::{Mode, PodRecord},
};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error(transparent)]
    Ebpf(#[from] EbpfError),
    #[error(transparent)]
    Iptables(#[from] IptablesError),
    #[error(transparent)]
    Nftables(#[from] NftablesBackendError),
}

pub enum AnyBackend {
    Ebpf(Box<EbpfBackend>),
    Iptables(IptablesBackend),
    Nftables(NftablesBackend),
}

impl AnyBackend {
    /// The backend for `mode`, ready to attach: the ebpf one loads the node's programs, with
    /// maps of the node's sizing, if this node has none yet; the iptables one writes with the
    /// node's variant.
    pub fn for_attach(paths: &Paths, mode: Mode, node: &NodeChoices) -> Result<Self, BackendError> {
        Ok(match mode {
            Mode::Ebpf => Self::Ebpf(Box::new(EbpfBackend::open(paths, node.sizing)?)),
            Mode::Iptables => Self::Iptables(IptablesBackend {
                flavour: node.iptables.choice().flavour,
            }),
            Mode::Nftables => Self::Nftables(NftablesBackend),
        })
    }

    /// The backend for `mode` as already present on the node, never loading anything.
    pub fn existing(paths: &Paths, mode: Mode) -> Result<Self, BackendError> {
        Ok(match mode {
            Mode::Ebpf => Self::Ebpf(Box::new(EbpfBackend::adopt(paths)?)),
            // Removal and checks take each record's own variant.
            Mode::Iptables => Self::Iptables(IptablesBackend {
                flavour: Flavour::default(),
            }),
            Mode::Nftables => Self::Nftables(NftablesBackend),
        })
    }

    /// The backend of a captured pod as already present on the node, writing (when the pod's
    /// rules are rewritten) with the iptables variant its record names.
    pub fn of_record(paths: &Paths, record: &PodRecord) -> Result<Self, BackendError> {
        Ok(match record.mode {
            Mode::Iptables => Self::Iptables(IptablesBackend {
                flavour: record.iptables_flavour(),
            }),
            mode => Self::existing(paths, mode)?,
        })
    }

    pub fn attach(&mut self, pod: &PodTarget<'_>, cfg: &CaptureConfig) -> Result<(), BackendError> {
        match self {
            Self::Ebpf(b) => Ok(b.attach(pod, cfg)?),
            Self::Iptables(b) => Ok(b.attach(pod, cfg)?),
            Self::Nftables(b) => Ok(b.attach(pod, cfg)?),
        }
    }

    pub fn detach(&mut self, record: &PodRecord) -> Result<(), BackendError> {
        match self {
            Self::Ebpf(b) => Ok(Backend::detach(b.as_mut(), record)?),
            Self::Iptables(b) => Ok(b.detach(record)?),
            Self::Nftables(b) => Ok(b.detach(record)?),
        }
    }

    /// The iptables variant new pods' rules are written with (the iptables backend only).
    #[must_use]
    pub fn iptables_flavour(&self) -> Option<Flavour> {
        match self {
            Self::Ebpf(_) | Self::Nftables(_) => None,
            Self::Iptables(b) => Some(b.flavour),
        }
    }

    pub fn missing(&self, record: &PodRecord) -> Vec<String> {
        match self {
            Self::Ebpf(b) => b.missing(record),
            Self::Iptables(b) => b.missing(record),
            Self::Nftables(b) => b.missing(record),
        }
    }

    pub fn counters(&self, record: &PodRecord) -> Option<PodCounters> {
        match self {
            Self::Ebpf(b) => Backend::counters(b.as_ref(), record),
            Self::Iptables(b) => b.counters(record),
            Self::Nftables(b) => b.counters(record),
        }
    }

    /// How many destinations the pod has loopback addresses for (ebpf pods, where the node's
    /// programs have the stateless redirect).
    pub fn loopback_destinations(&self, record: &PodRecord) -> Option<usize> {
        match self {
            Self::Ebpf(b) => b.loopback_destinations(record.netns_cookie),
            Self::Iptables(_) | Self::Nftables(_) => None,
        }
    }

    pub fn program_build(&self, record: &PodRecord) -> Option<String> {
        match self {
            Self::Ebpf(b) => Backend::program_build(b.as_ref(), record),
            Self::Iptables(b) => b.program_build(record),
            Self::Nftables(b) => b.program_build(record),
        }
    }
}

/// The node's existing backends, each opened at most once (for read-only passes over many pods).
pub struct ExistingBackends<'p> {
    paths: &'p Paths,
    opened: Vec<(Mode, Result<AnyBackend, String>)>,
}

impl<'p> ExistingBackends<'p> {
    #[must_use]
    pub fn new(paths: &'p Paths) -> Self {
        Self {
            paths,
            opened: Vec::new(),
        }
    }

    /// The backend for `mode`, or why it cannot be opened on this node (not loaded, or pinned
    /// by a build whose maps this one cannot read).
    pub fn get(&mut self, mode: Mode) -> Result<&AnyBackend, &str> {
        let i = if let Some(i) = self.opened.iter().position(|(m, _)| *m == mode) {
            i
        } else {
            let opened = AnyBackend::existing(self.paths, mode).map_err(|e| e.to_string());
            self.opened.push((mode, opened));
            self.opened.len() - 1
        };
        self.opened[i].1.as_ref().map_err(String::as_str)
    }
}
