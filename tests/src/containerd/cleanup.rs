//! Taking down what a test's containerd leaves on the host: pod cgroups (in every hierarchy on a
//! hybrid host), mounts, and the shims that outlive it.

use std::path::{Path, PathBuf};

use crate::cni::remove_cgroup_tree;

/// Removes a pod cgroup in cgroup v2 and, on a hybrid host, in every v1 hierarchy runc used.
pub fn remove_cgroup_everywhere(v2_mount: &Path, cgroup: &Path) {
    remove_cgroup_tree(cgroup);
    if let Ok(rel) = cgroup.strip_prefix(v2_mount) {
        for mount in cgroup_v1_mounts() {
            let mirror = mount.join(rel);
            if mirror.exists() {
                remove_cgroup_tree(&mirror);
            }
        }
    }
}

pub fn cgroup_v1_mounts() -> Vec<PathBuf> {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace();
            let (_, point, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup").then(|| PathBuf::from(point))
        })
        .collect()
}

/// Mount points at or below `dir`, deepest first.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let mut points: Vec<PathBuf> = std::fs::read_to_string("/proc/self/mountinfo")
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(4).map(PathBuf::from))
        .filter(|p| p.starts_with(dir))
        .collect();
    points.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    points
}

/// SIGKILLs the shims of the containerd serving `socket` (they outlive a killed containerd).
pub fn kill_shims_of(socket: &Path) {
    let needle = socket.display().to_string();
    let Ok(procs) = std::fs::read_dir("/proc") else {
        return;
    };
    for entry in procs.flatten() {
        let Ok(pid) = entry.file_name().to_string_lossy().parse::<i32>() else {
            continue;
        };
        let cmdline = std::fs::read(entry.path().join("cmdline")).unwrap_or_default();
        let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
        if cmdline.contains("containerd-shim") && cmdline.contains(&needle) {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(pid),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
    }
}

/// Where containerd 1.6 makes directories whatever its configuration says, deepest first: its
/// shims' sockets, the containers' FIFOs, and its CNI library's cache of each network's result.
const FIXED_DIRS: &[&str] = &[
    "/run/containerd/s",
    "/run/containerd/fifo",
    "/run/containerd",
    "/var/lib/cni/results",
    "/var/lib/cni",
];

/// The runtimes of this test process that are alive: the [`FIXED_DIRS`] made here go with the
/// last of them. An empty one is not unused: a runtime that mounts its own directory over
/// /run/containerd, for a pod that mounts the node's, needs the empty directory on the host.
static LIVE_RUNTIMES: std::sync::Mutex<usize> = std::sync::Mutex::new(0);

/// Counts a runtime in, before it makes or uses any of the [`FIXED_DIRS`].
pub(super) fn runtime_starts() {
    fixed_dirs_made_here();
    *LIVE_RUNTIMES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner) += 1;
}

/// Counts a runtime out; the last one removes the [`FIXED_DIRS`] this process made that are
/// empty (one in use, a shim's socket or a cached result inside, stays).
pub(super) fn runtime_ended() {
    let mut live = LIVE_RUNTIMES
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *live = live.saturating_sub(1);
    if *live == 0 {
        for dir in fixed_dirs_made_here() {
            let _ = std::fs::remove_dir(dir);
        }
    }
}

/// The [`FIXED_DIRS`] that did not exist when this test process first started a containerd.
fn fixed_dirs_made_here() -> &'static [&'static Path] {
    static MADE: std::sync::OnceLock<Vec<&'static Path>> = std::sync::OnceLock::new();
    MADE.get_or_init(|| {
        FIXED_DIRS
            .iter()
            .map(Path::new)
            .filter(|d| !d.exists())
            .collect()
    })
}
