//! The app-to-proxy acceleration as the node decides it: a pod asks (`capture.dev/accelerate`),
//! the node allows (the agent's `--accelerate`), and the node's kernel must have passed the
//! correctness checks (`check`) with this build. Off unless all three hold.

mod case_io;
pub mod cases;
pub mod check;

use std::path::PathBuf;

use capture_common::config::AccelCounters;
use serde::{Deserialize, Serialize};

use crate::{paths::Paths, record::PodRecord};

/// The node's acceleration setting and the last check's verdict (`<state>/acceleration.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAcceleration {
    /// The agent allows it (`--accelerate`).
    pub allowed: bool,
    /// Cases whose difference the operator accepts (`--accelerate-accepting`): a kernel that
    /// differs only in those is accelerated anyway.
    #[serde(default)]
    pub accepted: Vec<String>,
    #[serde(default)]
    pub check: Option<Verdict>,
}

/// A case whose answers differed, or that could not run.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FailedCase {
    pub name: String,
    pub plain: String,
    pub accelerated: String,
}

/// What the correctness checks concluded on one kernel with one build.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Verdict {
    pub kernel: String,
    pub build: String,
    pub cases: usize,
    pub failed: Vec<FailedCase>,
    /// Bytes the accelerated run moved through the `sk_msg` program: zero means acceleration never
    /// took, and the comparison proved nothing (not a difference anyone can accept).
    pub accelerated_bytes: u64,
    pub checked_at_unix: u64,
}

impl Verdict {
    /// Whether it speaks for this kernel and this build.
    #[must_use]
    pub fn is_current(&self) -> bool {
        self.kernel == kernel_release() && self.build == crate::ebpf::loader::build_name()
    }

    /// The differences not in `accepted`, by name (empty: the kernel may accelerate).
    #[must_use]
    pub fn unaccepted(&self, accepted: &[String]) -> Vec<String> {
        let mut out: Vec<String> = self
            .failed
            .iter()
            .filter(|f| !accepted.contains(&f.name))
            .map(|f| f.name.clone())
            .collect();
        if self.accelerated_bytes == 0 {
            out.push("no byte was accelerated".into());
        }
        out
    }
}

#[must_use]
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn file(paths: &Paths) -> PathBuf {
    paths.state_dir.join("acceleration.json")
}

/// The node's setting; the default (not allowed) when never written or unreadable.
#[must_use]
pub fn load(paths: &Paths) -> NodeAcceleration {
    std::fs::read(file(paths))
        .ok()
        .and_then(|b| serde_json::from_slice(&b).ok())
        .unwrap_or_default()
}

pub fn save(paths: &Paths, node: &NodeAcceleration) -> std::io::Result<()> {
    let json = serde_json::to_vec_pretty(node).expect("serialisable");
    crate::fsutil::write_atomic(&file(paths), &json, None)
}

/// Why pods of this node are not accelerated now, or `None` when they may be.
#[must_use]
pub fn why_not(paths: &Paths) -> Option<String> {
    let node = load(paths);
    if !node.allowed {
        return Some(
            "the node does not allow acceleration (start the agent with --accelerate)".into(),
        );
    }
    if let Some(refused) = crate::ebpf::node::read_node_record(paths)
        .and_then(|r| crate::ebpf::accel::refusal(&r.unavailable).cloned())
    {
        return Some(format!(
            "the kernel refused the acceleration's sk_msg program: {}",
            refused.reason
        ));
    }
    match node.check {
        Some(v) if v.is_current() => {
            let unaccepted = v.unaccepted(&node.accepted);
            (!unaccepted.is_empty()).then(|| {
                format!(
                    "the acceleration checks found differences on kernel {}: {} (`capture accel-check` shows them)",
                    v.kernel,
                    unaccepted.join(", ")
                )
            })
        }
        _ => Some(format!(
            "the acceleration checks have not finished on kernel {} with build {} (the agent with --accelerate runs them in the background at its start, and pods captured before they end are not accelerated; `capture accel-check` runs them by hand)",
            kernel_release(),
            crate::ebpf::loader::build_name()
        )),
    }
}

/// The node's acceleration as `capture doctor` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct NodeReport {
    #[serde(flatten)]
    pub setting: NodeAcceleration,
    /// Pods that ask are accelerated now (`why_not` is empty).
    pub accelerating: bool,
    pub why_not: Option<String>,
}

#[must_use]
pub fn node_report(paths: &Paths) -> NodeReport {
    let why_not = why_not(paths);
    NodeReport {
        setting: load(paths),
        accelerating: why_not.is_none(),
        why_not,
    }
}

/// A pod's acceleration as status shows it (only for pods that asked).
#[derive(Clone, Debug, Serialize)]
pub struct PodAcceleration {
    pub active: bool,
    /// Why not, when not active.
    pub reason: Option<String>,
    pub counters: Option<AccelCounters>,
}

/// The acceleration of a recorded pod, if it asked for it.
#[must_use]
pub fn of_pod(
    paths: &Paths,
    record: &PodRecord,
    counters: Option<AccelCounters>,
) -> Option<PodAcceleration> {
    let asked = record
        .annotations
        .get(crate::config::ANN_ACCELERATE)
        .is_some_and(|v| v.trim() == "true");
    if !asked {
        return None;
    }
    let active = record.config.accelerate;
    let reason = (!active).then(|| {
        if record.mode == crate::record::Mode::Ebpf {
            why_not(paths).unwrap_or_else(|| {
                "the node allowed acceleration after the pod was captured (it applies to pods captured from now on)".into()
            })
        } else {
            "the pod is captured by the iptables backend, which has no acceleration".into()
        }
    });
    Some(PodAcceleration {
        active,
        reason,
        counters: counters.filter(|_| active),
    })
}
