//! What the running kernel (or node) offers, for tests that cover a feature some lack. Such a test
//! skips where the feature is missing and says why: it prints the reason and, when
//! `CAPTURE_SKIP_LOG` is set (the kernel matrix, `cargo xtask vm`), appends
//! `TEST<TAB>FEATURE<TAB>REASON` to that file, so that a skip on a kernel that should have the
//! feature fails the matrix.

use std::{io::Write as _, sync::OnceLock};

use capture_user::ebpf::loader::{kernel_features, KernelFeatures};

/// A kernel feature some tests depend on; the name is what the skip log and the matrix use.
#[derive(Clone, Copy, Debug)]
pub enum Feature {
    /// `sock_ops` may ask for the netns cookie (Linux 5.15+).
    SockOpsNetnsCookie,
    /// The programs read a TCP socket's owner from its file's credentials (needs the netns
    /// cookie in `sock_ops`, and a verifier that lets `sock_addr` programs walk the structs).
    OwnerFromFile,
    /// IPv4 TCP redirects go to a loopback address per destination, with no per-connection
    /// state (needs `OwnerFromFile`).
    StatelessRedirect,
    /// The cpu controller is on cgroup v2 (not bound to a v1 hierarchy, as on a hybrid host):
    /// runc's systemd driver in unified mode sets every container's cpu.weight. Not a kernel
    /// feature but the node's set-up; the kernel matrix's guests mount cgroup v2 alone.
    UnifiedCgroupControllers,
    /// runc can start a container: runc 1.1 re-executes itself from a sealed copy first, which
    /// fails on the kernel matrix's 5.10 guest (its root a 9p mount chrooted on the initramfs):
    /// "could not ensure we are a cloned binary". A gap of that harness, not of capture or nodes.
    RuncClonedBinary,
    /// The acceleration's `sk_msg` program loads: it reads socket-local storage through the
    /// message's socket and attaches to a sockhash. Known from the node record (the agent's
    /// load tells).
    SkMsgAcceleration,
    /// The node paths a DaemonSet's hostPath volumes name (/opt/cni/bin, /etc/cni/net.d, ...)
    /// exist or can be made: not on the kernel matrix's guests, whose root is the host's, read
    /// only. A gap of that harness, not of capture or nodes.
    WritableNodePaths,
    /// A cgroup v1 hierarchy can be mounted (a named one, no controllers), to stand for a node
    /// booted without cgroup v2. Known from a failure: see `record_skip`.
    CgroupV1Hierarchy,
}

impl Feature {
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::SockOpsNetnsCookie => "sock_ops_netns_cookie",
            Self::OwnerFromFile => "owner_from_file",
            Self::StatelessRedirect => "stateless_redirect",
            Self::UnifiedCgroupControllers => "unified_cgroup_controllers",
            Self::RuncClonedBinary => "runc_cloned_binary",
            Self::SkMsgAcceleration => "sk_msg_acceleration",
            Self::WritableNodePaths => "writable_node_paths",
            Self::CgroupV1Hierarchy => "cgroup_v1_hierarchy",
        }
    }
}

/// How the kernel programs were adapted to this kernel (loaded once per test binary).
#[must_use]
pub fn features() -> KernelFeatures {
    static FEATURES: OnceLock<KernelFeatures> = OnceLock::new();
    *FEATURES.get_or_init(|| {
        kernel_features().unwrap_or_else(|e| panic!("the kernel programs load on this kernel: {e}"))
    })
}

/// Whether the kernel has `feature`; if not, records the skip with `reason` and returns false.
/// Where a node has what the DaemonSet's hostPath volumes name: the CNI bin and configuration
/// directories, capture's state directory, bpffs (`Feature::WritableNodePaths` asks whether
/// they can be made here).
pub const NODE_MOUNT_POINTS: [&str; 4] = [
    "/opt/cni/bin",
    "/etc/cni/net.d",
    "/run/capture",
    "/sys/fs/bpf",
];

#[must_use]
pub fn has_or_skip(feature: Feature, reason: &str) -> bool {
    let present = match feature {
        Feature::SockOpsNetnsCookie => features().sock_ops_netns_cookie,
        Feature::OwnerFromFile => features().owner_from_file,
        Feature::StatelessRedirect => features().stateless_redirect,
        Feature::UnifiedCgroupControllers => capture_user::cgroup::cgroup2_mount()
            .ok()
            .and_then(|m| std::fs::read_to_string(m.join("cgroup.controllers")).ok())
            .is_some_and(|c| c.split_whitespace().any(|c| c == "cpu")),
        Feature::WritableNodePaths => NODE_MOUNT_POINTS
            .iter()
            .all(|p| can_be_made(std::path::Path::new(p))),
        // Known only from a failure or a node's load: see record_skip.
        Feature::RuncClonedBinary | Feature::SkMsgAcceleration | Feature::CgroupV1Hierarchy => true,
    };
    if !present {
        record_skip(feature, reason);
    }
    present
}

/// Whether `path` exists, or its nearest existing ancestor is on a writable filesystem.
fn can_be_made(path: &std::path::Path) -> bool {
    let Some(existing) = path.ancestors().find(|p| p.exists()) else {
        return false;
    };
    existing == path
        || nix::sys::statvfs::statvfs(existing)
            .is_ok_and(|s| !s.flags().contains(nix::sys::statvfs::FsFlags::ST_RDONLY))
}

/// Records that the running test skips for `feature`, which it found missing, with `reason`.
pub fn record_skip(feature: Feature, reason: &str) {
    let test = std::thread::current()
        .name()
        .unwrap_or("unnamed test")
        .to_string();
    eprintln!("skipped {test}: {} is missing: {reason}", feature.name());
    if let Some(path) = std::env::var_os("CAPTURE_SKIP_LOG") {
        let mut log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .unwrap_or_else(|e| panic!("opening CAPTURE_SKIP_LOG {}: {e}", path.display()));
        // One write per record: `writeln!` on a file writes each piece on its own, and the
        // records of tests skipping side by side then interleave.
        let record = format!("{test}\t{}\t{reason}\n", feature.name());
        log.write_all(record.as_bytes())
            .expect("writing the skip log");
    }
}
