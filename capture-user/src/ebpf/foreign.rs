//! Other programs on the cgroups above the pods (a network plugin's socket load balancer, for
//! one). The kernel runs the programs of a pod's own cgroup first and then those of each parent
//! up to the root, so such a program sees a connection after capture has rewritten it: an app's
//! connection arrives there already headed for the proxy, and the proxy's own connections reach
//! it untouched. `capture doctor` lists them, so an operator sees who else decides there.

use std::{
    collections::BTreeSet,
    fs,
    os::fd::AsFd as _,
    path::{Path, PathBuf},
};

use super::{
    hooks::{Target, HOOKS},
    sys,
};
use crate::record::PodRecord;

/// A program attached to a cgroup above some pod.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ForeignProgram {
    pub cgroup: PathBuf,
    pub hook: &'static str,
    pub id: u32,
    pub name: String,
}

/// The programs attached, at the hooks capture uses, to every cgroup between the pods' cgroups
/// (exclusive) and the cgroup2 root (inclusive).
#[must_use]
pub fn above_pods(root: &Path, pods: &[PodRecord]) -> Vec<ForeignProgram> {
    let mut cgroups = BTreeSet::new();
    for pod in pods {
        let mut dir = pod.cgroup.parent();
        while let Some(d) = dir.filter(|d| d.starts_with(root)) {
            cgroups.insert(d.to_path_buf());
            dir = d.parent();
        }
    }
    let mut found = Vec::new();
    for cgroup in cgroups {
        let Ok(file) = fs::File::open(&cgroup) else {
            continue;
        };
        for hook in HOOKS.iter().filter(|h| h.target == Target::Cgroup) {
            for id in sys::prog_query(file.as_fd(), hook.attach_type).unwrap_or_default() {
                found.push(ForeignProgram {
                    cgroup: cgroup.clone(),
                    hook: hook.hook,
                    id,
                    name: sys::prog_name(id).unwrap_or_default(),
                });
            }
        }
    }
    found
}
