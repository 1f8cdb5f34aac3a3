//! Every path capture keeps state under: one bpffs directory for pinned kernel objects and one
//! runtime directory for pod records and the node lock; and where the node's processes are
//! seen (`host_proc`).

use std::{
    fs, io,
    os::unix::fs::MetadataExt as _,
    path::{Component, Path, PathBuf},
};

use nix::{
    mount::{mount, MsFlags},
    sys::statfs::{statfs, BPF_FS_MAGIC},
};

pub const DEFAULT_BPFFS_DIR: &str = "/sys/fs/bpf/capture";
pub const DEFAULT_STATE_DIR: &str = "/run/capture";
const BPFFS_MOUNT: &str = "/sys/fs/bpf";
/// Where the node's /proc is mounted, when it is not this process's own: an agent in a container
/// without the node's PID namespace (deploy/capture.yaml mounts it at /host/proc).
pub const HOST_PROC_VAR: &str = "CAPTURE_HOST_PROC";

/// The node's /proc: `CAPTURE_HOST_PROC`, else /proc. PIDs read there are the node's, which
/// runtimes and CNI give (`/proc/<pid>/ns/net`), not this process's where it runs in a PID
/// namespace of its own.
#[must_use]
pub fn host_proc() -> PathBuf {
    std::env::var_os(HOST_PROC_VAR)
        .filter(|v| !v.is_empty())
        .map_or_else(|| PathBuf::from("/proc"), PathBuf::from)
}

/// A path that a runtime or CNI gives in the node's PID numbering, `/proc/<pid>/...`, as this
/// process reaches it: under `host_proc()`. Every other path, `/proc/self` and
/// `/proc/thread-self` among them (they name this process), is returned as it is.
#[must_use]
pub fn on_node(path: &Path) -> PathBuf {
    under_host_proc(path, &host_proc())
}

fn under_host_proc(path: &Path, host_proc: &Path) -> PathBuf {
    let Ok(rest) = path.strip_prefix("/proc") else {
        return path.into();
    };
    match rest.components().next() {
        Some(Component::Normal(pid)) if pid.to_str().is_some_and(is_pid) => host_proc.join(rest),
        _ => path.into(),
    }
}

fn is_pid(name: &str) -> bool {
    !name.is_empty() && name.bytes().all(|b| b.is_ascii_digit())
}

#[derive(Debug, thiserror::Error)]
pub enum PathsError {
    #[error("{path} is not on a bpf filesystem; mount one (mount -t bpf bpf /sys/fs/bpf) or pass --bpffs under one")]
    NotBpffs { path: PathBuf },
    #[error("{BPFFS_MOUNT} is not a bpf filesystem here, and one mounted from this mount namespace (a container's) would not be the node's: the pins would go with the container. Mount it on the node (mount -t bpf bpf /sys/fs/bpf; systemd does at boot) and give the container the node's /sys/fs/bpf (deploy/capture.yaml's bpffs volume)")]
    NodeBpffsMissing,
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
}

#[derive(Clone, Debug)]
pub struct Paths {
    /// Pinned programs, maps and per-pod links.
    pub bpffs: PathBuf,
    /// Pod records and the node lock.
    pub state_dir: PathBuf,
}

impl Paths {
    #[must_use]
    pub fn new(bpffs: impl Into<PathBuf>, state_dir: impl Into<PathBuf>) -> Self {
        Self {
            bpffs: bpffs.into(),
            state_dir: state_dir.into(),
        }
    }

    /// Every build's pins: `builds/<object id>/{programs,maps}`.
    #[must_use]
    pub fn builds_dir(&self) -> PathBuf {
        self.bpffs.join("builds")
    }

    /// One build's program and map pins (the node record says which build is the node's).
    #[must_use]
    pub fn build_pin_dir(&self, object_id: &str) -> PathBuf {
        self.builds_dir().join(object_id)
    }

    /// Where the pods' links are pinned, one directory per pod.
    #[must_use]
    pub fn links_root(&self) -> PathBuf {
        self.bpffs.join("pods")
    }

    /// Where one pod's links are pinned, named by its netns cookie.
    #[must_use]
    pub fn pod_links_dir(&self, netns_cookie: u64) -> PathBuf {
        self.links_root().join(netns_cookie.to_string())
    }

    #[must_use]
    pub fn records_dir(&self) -> PathBuf {
        self.state_dir.join("pods")
    }

    #[must_use]
    pub fn record_path(&self, netns_cookie: u64) -> PathBuf {
        self.records_dir().join(format!("{netns_cookie}.json"))
    }

    /// Which record holds a container's pod: a file per container id naming the pod's netns
    /// cookie (see `record::find`), so that CNI DEL reads one record, not the node's.
    #[must_use]
    pub fn container_index_dir(&self) -> PathBuf {
        self.state_dir.join("pods-by-container")
    }

    #[must_use]
    pub fn container_index_path(&self, container_id: &str) -> PathBuf {
        self.container_index_dir()
            .join(crate::fsutil::container_file_name(container_id))
    }

    /// The agent's CNI claims, one file per container id (see `claims`).
    #[must_use]
    pub fn claims_dir(&self) -> PathBuf {
        self.state_dir.join("cni-claims")
    }

    /// The pods Istio injected that capture leaves alone, one report per container id (see
    /// `left_alone`).
    #[must_use]
    pub fn left_alone_dir(&self) -> PathBuf {
        self.state_dir.join("left-alone")
    }

    /// The agent's mesh configuration as status shows it (see `agent::mesh_watch`).
    #[must_use]
    pub fn mesh_config_report_path(&self) -> PathBuf {
        self.state_dir.join("mesh-config.json")
    }

    /// Every revision's mesh configuration, where `--mesh-config` is a directory.
    #[must_use]
    pub fn mesh_configs_report_path(&self) -> PathBuf {
        self.state_dir.join("mesh-configs.json")
    }

    /// capture-cni's place in the node's CNI configuration as the agent's watcher last saw it
    /// (see `agent::cni_fight`).
    #[must_use]
    pub fn cni_chain_report_path(&self) -> PathBuf {
        self.state_dir.join("cni-chain.json")
    }

    #[must_use]
    pub fn lock_path(&self) -> PathBuf {
        self.state_dir.join("lock")
    }

    /// Serialises trace sessions' claims of slots (`capture trace`); never held for long.
    #[must_use]
    pub fn trace_lock_path(&self) -> PathBuf {
        self.state_dir.join("trace.lock")
    }

    #[must_use]
    pub fn node_record_path(&self) -> PathBuf {
        self.state_dir.join("node.json")
    }

    /// Creates the directories, mounting bpffs at /sys/fs/bpf first if the pin directory is
    /// below it and nothing is mounted there yet, but only in the node's mount namespace: in a
    /// container's the mount would stay there, and the pins would go with it.
    pub fn prepare(&self) -> Result<(), PathsError> {
        if self.bpffs.starts_with(BPFFS_MOUNT) && !is_bpffs(Path::new(BPFFS_MOUNT)) {
            if !in_node_mount_namespace() {
                return Err(PathsError::NodeBpffsMissing);
            }
            mount(
                Some("bpf"),
                BPFFS_MOUNT,
                Some("bpf"),
                MsFlags::empty(),
                None::<&str>,
            )
            .map_err(|e| PathsError::Io {
                path: BPFFS_MOUNT.into(),
                source: e.into(),
            })?;
        }
        let io_err = |path: &Path| {
            let path = path.to_path_buf();
            move |source| PathsError::Io { path, source }
        };
        fs::create_dir_all(&self.bpffs).map_err(io_err(&self.bpffs))?;
        if !is_bpffs(&self.bpffs) {
            return Err(PathsError::NotBpffs {
                path: self.bpffs.clone(),
            });
        }
        for dir in [self.builds_dir(), self.links_root(), self.records_dir()] {
            fs::create_dir_all(&dir).map_err(io_err(&dir))?;
        }
        Ok(())
    }
}

fn is_bpffs(path: &Path) -> bool {
    statfs(path).is_ok_and(|s| s.filesystem_type() == BPF_FS_MAGIC)
}

/// Whether this process shares the node's mount namespace (that of the node's init, pid 1 of
/// `host_proc()`). Not knowing counts as not: a mount nobody else sees is the worse mistake.
fn in_node_mount_namespace() -> bool {
    let inode = |p: &Path| fs::metadata(p).map(|m| (m.dev(), m.ino()));
    match (
        inode(Path::new("/proc/self/ns/mnt")),
        inode(&host_proc().join("1/ns/mnt")),
    ) {
        (Ok(own), Ok(node)) => own == node,
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_pids_are_reached_under_the_nodes_proc() {
        let host = Path::new("/host/proc");
        let on_node = |p: &str| under_host_proc(Path::new(p), host);
        assert_eq!(on_node("/proc/42/ns/net"), host.join("42/ns/net"));
        assert_eq!(
            on_node("/proc/42/task/43/ns/net"),
            host.join("42/task/43/ns/net")
        );
        // This process's own, and what is not a pid's, stay as they are.
        for own in [
            "/proc/self/ns/net",
            "/proc/thread-self/ns/net",
            "/proc/self/fd/3",
            "/var/run/netns/cni-1",
            "/proc",
            "/proc/sys/net",
            "/procfs/42/ns/net",
        ] {
            assert_eq!(on_node(own), Path::new(own));
        }
    }
}
