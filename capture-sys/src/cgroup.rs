//! cgroup directories: verify the pod's (v2 for the ebpf backend; the rule backends take a v1 one
//! too), and find where cgroup2 and the v1 hierarchies are mounted.

use std::{
    ffi::CString,
    fs::{self, File},
    io,
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::{ffi::OsStringExt as _, fs::MetadataExt as _},
    },
    path::{Path, PathBuf},
};

use nix::sys::statfs::{statfs, CGROUP2_SUPER_MAGIC, CGROUP_SUPER_MAGIC};

#[derive(Debug, thiserror::Error)]
pub enum CgroupError {
    #[error("cgroup {path}: {source}; pass the pod's cgroup v2 directory (under the cgroup2 mount{mount_hint})")]
    Open {
        path: PathBuf,
        source: io::Error,
        mount_hint: String,
    },
    #[error("cgroup {path} is not a cgroup v2 directory (nor a v1 one); pass the pod's directory under the cgroup2 mount{mount_hint}")]
    NotCgroup2 { path: PathBuf, mount_hint: String },
    #[error("no cgroup2 filesystem is mounted (see /proc/self/mounts); capture needs cgroup v2")]
    NoCgroup2,
}

/// Which cgroup hierarchy a pod's cgroup directory belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// The unified hierarchy: programs attach to it.
    V2,
    /// A v1 hierarchy (a node booted without cgroup v2, or a controller's tree on a hybrid one):
    /// no cgroup programs attach to it; rules in the pod's netns need no cgroup at all.
    V1,
}

/// Opens a pod's cgroup directory, v2 or v1, and says which.
pub fn open_pod_cgroup(path: &Path) -> Result<(File, Layout), CgroupError> {
    let open_err = |source| CgroupError::Open {
        path: path.into(),
        source,
        mount_hint: mount_hint(),
    };
    let meta = fs::metadata(path).map_err(open_err)?;
    let fs = statfs(path).map_err(|e| open_err(io::Error::from(e)))?;
    let not_cgroup = || CgroupError::NotCgroup2 {
        path: path.into(),
        mount_hint: mount_hint(),
    };
    let layout = match fs.filesystem_type() {
        _ if !meta.is_dir() => return Err(not_cgroup()),
        CGROUP2_SUPER_MAGIC => Layout::V2,
        CGROUP_SUPER_MAGIC => Layout::V1,
        _ => return Err(not_cgroup()),
    };
    Ok((File::open(path).map_err(open_err)?, layout))
}

/// Where the cgroup v1 hierarchies are mounted, the named `systemd` one first (the one kubelet's
/// systemd driver and every controller's tree mirror), then the others.
#[must_use]
pub fn cgroup1_mounts() -> Vec<PathBuf> {
    let Ok(mounts) = fs::read_to_string("/proc/self/mounts") else {
        return Vec::new();
    };
    let mut found: Vec<(bool, PathBuf)> = mounts
        .lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let (_src, target, fstype, opts) = (f.next()?, f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup").then(|| {
                let systemd = opts.split(',').any(|o| o == "name=systemd");
                (!systemd, PathBuf::from(target.replace("\\040", " ")))
            })
        })
        .collect();
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

fn mount_hint() -> String {
    cgroup2_mount()
        .map(|m| format!(", here {}", m.display()))
        .unwrap_or_default()
}

/// Opens a cgroup v2 directory for attaching programs to it.
pub fn open_cgroup2(path: &Path) -> Result<File, CgroupError> {
    match open_pod_cgroup(path)? {
        (file, Layout::V2) => Ok(file),
        (_, Layout::V1) => Err(CgroupError::NotCgroup2 {
            path: path.into(),
            mount_hint: mount_hint(),
        }),
    }
}

/// Where cgroup2 is mounted (`/sys/fs/cgroup` on most nodes, `/sys/fs/cgroup/unified` on hybrid
/// hosts), read from `/proc/self/mounts`.
pub fn cgroup2_mount() -> Result<PathBuf, CgroupError> {
    let mounts = fs::read_to_string("/proc/self/mounts").map_err(|_| CgroupError::NoCgroup2)?;
    mounts
        .lines()
        .find_map(|line| {
            let mut f = line.split_whitespace();
            let (_src, target, fstype) = (f.next()?, f.next()?, f.next()?);
            (fstype == "cgroup2").then(|| PathBuf::from(target.replace("\\040", " ")))
        })
        .ok_or(CgroupError::NoCgroup2)
}

/// A private cgroup directly under the cgroup2 root, for capture's own short-lived probes;
/// removed on drop (it must be empty by then).
pub struct ScratchCgroup {
    pub path: PathBuf,
}

impl ScratchCgroup {
    /// `capture-PURPOSE-PID-N` under the cgroup2 mount, PID as the node numbers this process.
    pub fn create(purpose: &str) -> io::Result<Self> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let root = cgroup2_mount().map_err(io::Error::other)?;
        let path = root.join(format!(
            "capture-{purpose}-{}-{}",
            node_pid(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        fs::create_dir(&path)?;
        Ok(Self { path })
    }
}

/// Moves a forked child into a cgroup that the caller's cgroup namespace may not reach.
///
/// On a hierarchy mounted with `nsdelegate` (systemd's default), the kernel lets a process move
/// another only between cgroups its cgroup namespace can see, and it judges that by the namespace
/// of whoever opened `cgroup.procs` (since Linux 5.16, and in the stable kernels the fix went
/// back to). An agent in a container with a cgroup namespace of its own (containerd's default on
/// cgroup v2, privileged or not) sees only its container's cgroup, so moving a child into a
/// scratch cgroup at the root fails with ENOENT. The child then enters the node's cgroup
/// namespace (that of the node's init, pid 1 of the node's /proc: `paths::host_proc`, which
/// the container has at /host/proc) and opens the file again there. Opening another process's
/// namespace needs ptrace access to it (`CAP_SYS_PTRACE` over the node's init), entering it
/// `CAP_SYS_ADMIN`.
pub struct CgroupJoin {
    procs: CString,
    node_cgroupns: Option<OwnedFd>,
}

impl CgroupJoin {
    /// Prepares the move into `cgroup` (before the fork: the child makes only raw system calls).
    pub fn new(cgroup: &Path) -> io::Result<Self> {
        let procs = CString::new(cgroup.join("cgroup.procs").into_os_string().into_vec())
            .map_err(io::Error::other)?;
        let inode = |p: &Path| fs::metadata(p).map(|m| m.ino());
        let node = crate::paths::host_proc().join("1/ns/cgroup");
        let node_cgroupns = match (inode(Path::new("/proc/self/ns/cgroup")), inode(&node)) {
            (Ok(own), Ok(theirs)) if own != theirs => Some(File::open(&node)?.into()),
            _ => None,
        };
        Ok(Self {
            procs,
            node_cgroupns,
        })
    }

    /// Whether the child can try again from another cgroup namespace (the node's init's).
    #[must_use]
    pub fn can_enter_node_cgroupns(&self) -> bool {
        self.node_cgroupns.is_some()
    }

    /// In the forked child: moves the calling process into the cgroup, from its own cgroup
    /// namespace first and, refused there, from the node's init's. `Err` holds the errno. Only raw system
    /// calls, which are async-signal-safe.
    pub fn join_from_child(&self) -> Result<(), i32> {
        // SAFETY: raw system calls on a descriptor and a C string this struct owns.
        unsafe {
            let errno = || *libc::__errno_location();
            let join = || {
                let fd = libc::open(self.procs.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC);
                if fd < 0 {
                    return Err(errno());
                }
                let written = libc::write(fd, b"0".as_ptr().cast(), 1) == 1;
                let err = errno();
                libc::close(fd);
                if written {
                    Ok(())
                } else {
                    Err(err)
                }
            };
            match (join(), &self.node_cgroupns) {
                (Err(libc::ENOENT), Some(ns)) => {
                    if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWCGROUP) != 0 {
                        return Err(errno());
                    }
                    join()
                }
                (joined, _) => joined,
            }
        }
    }

    /// Why a child's move failed with `errno`, and what to do about it.
    #[must_use]
    pub fn explain(&self, errno: i32) -> String {
        let err = io::Error::from_raw_os_error(errno);
        let hint = if errno == libc::ENOENT && !self.can_enter_node_cgroupns() {
            "; a process in a cgroup namespace of its own may not move processes to cgroups \
             outside it where cgroup2 is mounted with nsdelegate, and pid 1 of the node's /proc \
             here is in the same namespace: give the container the node's /proc and name it \
             in CAPTURE_HOST_PROC (as deploy/capture.yaml does), or run it with the node's \
             cgroup namespace"
        } else {
            ""
        };
        format!(
            "joining the cgroup {}: {err}{hint}",
            self.procs
                .to_string_lossy()
                .trim_end_matches("/cgroup.procs")
        )
    }
}

/// This process's PID in the node's numbering: `self` in the node's /proc (`paths::host_proc`)
/// names whoever reads it as that /proc's PID namespace numbers it. An agent in a PID namespace
/// of its own would otherwise name its scratch cgroups by a PID (1, say) that means another
/// process on the node, and judge others' cgroups by PIDs it cannot see.
fn node_pid() -> u32 {
    fs::read_link(crate::paths::host_proc().join("self"))
        .ok()
        .and_then(|pid| pid.to_str()?.parse().ok())
        .unwrap_or_else(std::process::id)
}

/// Removes the scratch cgroups of processes that died without removing them (an agent killed
/// during a probe or a check): `capture-PURPOSE-PID-N` whose PID the node's /proc no longer
/// lists. Only empty cgroups can be removed, so a cgroup still in use stays.
pub fn remove_stale_scratch() {
    let Ok(root) = cgroup2_mount() else {
        return;
    };
    for entry in fs::read_dir(&root).into_iter().flatten().flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix("capture-")) else {
            continue;
        };
        let mut parts = rest.rsplit('-');
        let (Some(_n), Some(pid)) = (parts.next(), parts.next()) else {
            continue;
        };
        let Ok(pid) = pid.parse::<i32>() else {
            continue;
        };
        // Not kill(pid, 0): that asks this process's PID namespace, where the node's other
        // processes (the previous agent mid-probe, a CLI run on the node) do not exist.
        if !crate::paths::host_proc().join(pid.to_string()).exists() {
            let _ = fs::remove_dir(entry.path());
        }
    }
}

impl Drop for ScratchCgroup {
    fn drop(&mut self) {
        let _ = fs::remove_dir(&self.path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_move_names_the_cgroup_and_what_the_agent_needs() {
        let join = CgroupJoin {
            procs: CString::new("/sys/fs/cgroup/capture-probe-1-0/cgroup.procs").unwrap(),
            node_cgroupns: None,
        };
        let refused = join.explain(libc::ENOENT);
        assert!(
            refused.starts_with("joining the cgroup /sys/fs/cgroup/capture-probe-1-0: ")
                && refused.contains("nsdelegate")
                && refused.contains("CAPTURE_HOST_PROC"),
            "{refused}"
        );
        let other = join.explain(libc::EACCES);
        assert!(!other.contains("CAPTURE_HOST_PROC"), "{other}");
    }
}
