//! The root a guest of another architecture than this machine's boots into. An amd64 guest shares
//! this machine's root (its programs run there unchanged); an arm64 guest cannot, so it gets a
//! tree of Debian's arm64 packages of the same release, fetched by a private apt and unpacked
//! (image/sources.rs) with what their maintainer scripts would have added, and the workspace,
//! where the cross-built test binaries are, shared beside it.

use std::{
    fs,
    os::unix::fs::symlink,
    path::{Path, PathBuf},
};

use anyhow::{Context as _, Result};

use crate::image::{
    arch::Arch,
    layer::{of_variant, IPTABLES_NAMES},
    sources::{PackageRoot, PackageSet},
};

/// What stage 2 and the verifier and hooks tiers run: bash and the tools it mounts and loads
/// modules with, iproute2, both iptables variants and nft (which capture and the tests call),
/// bpftool (the pinned maps' checks), HAProxy (a real transparent proxy as the sidecar), the
/// reference CNI plugins (the plugin chained after bridge) and a static busybox for the
/// initramfs. `base-files` gives the root its directories.
pub const VM_PACKAGES: PackageSet = PackageSet {
    name: "vm",
    wanted: &[
        "base-files",
        "bash",
        "coreutils",
        "util-linux",
        "mount",
        "kmod",
        "procps",
        "grep",
        "sed",
        "findutils",
        "iproute2",
        "iptables",
        "nftables",
        "bpftool",
        "haproxy",
        "containernetworking-plugins",
        "busybox-static",
    ],
};

/// The directories stage 2 mounts on, whatever the packages ship.
const MOUNT_POINTS: [&str; 8] = ["proc", "sys", "dev", "run", "tmp", "var/lib", "etc", "root"];

/// `arch`'s guest root, fetched and unpacked if need be, with a mount point for each of `shares`
/// (this machine's directories the guest sees) at its own path: the root is read-only in the
/// guest.
pub fn prepare(arch: Arch, shares: &[PathBuf]) -> Result<PackageRoot> {
    let packages = PackageRoot::prepare(arch, &VM_PACKAGES)?;
    let root = packages.root();
    for dir in MOUNT_POINTS {
        fs::create_dir_all(root.join(dir))?;
    }
    for share in shares {
        let inside = share
            .strip_prefix("/")
            .with_context(|| format!("the share {} is not absolute", share.display()))?;
        fs::create_dir_all(root.join(inside))?;
    }
    // What update-alternatives would make: the unsuffixed iptables names are the nft variant's,
    // as on a fresh Debian machine; and /bin/sh (dash's postinst).
    for name in IPTABLES_NAMES {
        link(root, &format!("usr/sbin/{name}"), &of_variant(name, "nft"))?;
    }
    link(root, "bin/sh", "bash")?;
    // base-files ships them as directories and its postinst makes them links into /run, where
    // stage 2 mounts a tmpfs (`ip netns` keeps its namespaces in /var/run/netns).
    for (path, target) in [("var/run", "/run"), ("var/lock", "/run/lock")] {
        let at = root.join(path);
        if at.is_dir() && !at.is_symlink() {
            fs::remove_dir(&at).with_context(|| format!("{} is not empty", at.display()))?;
        }
        link(root, path, target)?;
    }
    merge_usr(root)?;
    Ok(packages)
}

/// Debian 12's packages still ship programs in /bin and /sbin (`/sbin/modprobe`), which a merged
/// /usr also shows under /usr: each gets a link there, so that a path written for either finds it.
fn merge_usr(root: &Path) -> Result<()> {
    for dir in ["bin", "sbin"] {
        let Ok(entries) = fs::read_dir(root.join(dir)) else {
            continue;
        };
        for entry in entries {
            let name = entry?.file_name();
            let name = name.to_string_lossy();
            // Relative, so that it also leads inside the tree when read from this machine.
            link(
                root,
                &format!("usr/{dir}/{name}"),
                &format!("../../{dir}/{name}"),
            )?;
        }
    }
    Ok(())
}

/// A link at `path` inside `root` to `target`, unless something is there already.
fn link(root: &Path, path: &str, target: &str) -> Result<()> {
    let at = root.join(path);
    if at.symlink_metadata().is_err() {
        symlink(target, &at).with_context(|| format!("linking {}", at.display()))?;
    }
    Ok(())
}
