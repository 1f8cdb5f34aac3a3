//! Debian kernels for the VM matrix. Each is fetched once with a private apt configuration (the
//! system's package lists are never read or written; its sources only name the archive), unpacked,
//! depmod'ed and cached under target/vm/kernels/<label>/; later runs reuse the unpacked tree
//! without the network.
//!
//! The generic flavours are used (`-amd64`, `-arm64`), not `-cloud-amd64`: the cloud kernels have
//! no 9p, and the guest reaches its root over 9p. Another architecture's kernel is found with apt
//! resolving for that architecture.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{Context as _, Result};

use crate::{
    image::arch::{self, Arch},
    output, run,
    setup::{apt_sources, private_apt::PrivateApt},
};

/// Written last into a kernel's cache directory: the release whose tree is complete and depmod'ed.
const STAMP: &str = "ready";

/// A kernel line of the matrix and the Debian release that ships it.
pub struct Line {
    /// What `--kernels` calls it: the upstream major.minor, and the architecture where it is not
    /// amd64 (`6.1-arm64`).
    pub label: &'static str,
    /// The upstream major.minor.
    pub version: &'static str,
    pub suite: &'static str,
    pub arch: Arch,
}

pub const LINES: [Line; 6] = [
    // Debian 11: the oldest long-term kernel still in service on nodes.
    Line {
        label: "5.10",
        version: "5.10",
        suite: "bullseye",
        arch: arch::AMD64,
    },
    // Debian 12.
    Line {
        label: "6.1",
        version: "6.1",
        suite: "bookworm",
        arch: arch::AMD64,
    },
    // Debian 13.
    Line {
        label: "6.12",
        version: "6.12",
        suite: "trixie",
        arch: arch::AMD64,
    },
    // The same releases' arm64 builds, emulated (qemu-system-aarch64, TCG).
    Line {
        label: "5.10-arm64",
        version: "5.10",
        suite: "bullseye",
        arch: arch::ARM64,
    },
    Line {
        label: "6.1-arm64",
        version: "6.1",
        suite: "bookworm",
        arch: arch::ARM64,
    },
    Line {
        label: "6.12-arm64",
        version: "6.12",
        suite: "trixie",
        arch: arch::ARM64,
    },
];

/// The line `--kernels` calls `label`.
pub fn line(label: &str) -> Option<&'static Line> {
    LINES.iter().find(|l| l.label == label)
}

/// An unpacked kernel package, ready to boot.
pub struct Kernel {
    /// `uname -r` of the kernel, e.g. `5.10.0-32-amd64`.
    pub release: String,
    pub vmlinuz: PathBuf,
    /// The unpacked package: `lib/modules/<release>` with modules.dep inside. The guest mounts
    /// it to load modules from (the host's own /lib/modules belongs to another kernel).
    pub root: PathBuf,
}

/// The cached kernel of `line`, fetching and unpacking it first if the cache does not hold it.
pub fn prepare(cache: &Path, line: &Line) -> Result<Kernel> {
    let dir = cache.join(line.label);
    if let Some(kernel) = cached(&dir) {
        return Ok(kernel);
    }
    println!(
        "vm {}: fetching the newest Debian {} kernel",
        line.label, line.suite
    );
    fs::create_dir_all(&dir)?;
    let apt = if line.arch.is_host() {
        PrivateApt::own_sources(&dir.join("apt"))?
    } else {
        PrivateApt::own_sources_for(&dir.join("apt"), line.arch.debian)?
    };
    let name = newest_image(&apt, line)?;
    let release = name
        .strip_prefix("linux-image-")
        .context("package name without linux-image- prefix")?
        .to_string();
    for old in fs::read_dir(&dir)?.filter_map(Result::ok) {
        if old.file_name().to_string_lossy().ends_with(".deb") {
            fs::remove_file(old.path())?;
        }
    }
    run(apt
        .command("apt-get")
        .args(["-q", "download", &name])
        .current_dir(&dir))?;
    let deb = fs::read_dir(&dir)?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name().is_some_and(|n| {
                let n = n.to_string_lossy();
                n.starts_with(&format!("{name}_")) && n.ends_with(".deb")
            })
        })
        .with_context(|| format!("apt-get download {name} left no .deb in {}", dir.display()))?;
    let root = dir.join("root");
    if root.exists() {
        fs::remove_dir_all(&root)?;
    }
    run(Command::new("dpkg-deb").arg("-x").arg(&deb).arg(&root))?;
    // Newer packages ship their modules under usr/lib only (merged /usr); modprobe -d wants lib/.
    if !root.join("lib").exists() {
        std::os::unix::fs::symlink("usr/lib", root.join("lib"))?;
    }
    run(Command::new("depmod").arg("-b").arg(&root).arg(&release))?;
    fs::remove_file(&deb)?;
    fs::write(dir.join(STAMP), format!("{release}\n"))?;
    cached(&dir).context("the unpacked kernel is incomplete")
}

/// The kernel in `dir` if an earlier run finished unpacking it.
fn cached(dir: &Path) -> Option<Kernel> {
    let stamp = fs::read_to_string(dir.join(STAMP)).ok()?;
    let release = stamp.trim().to_string();
    let root = dir.join("root");
    let vmlinuz = root.join(format!("boot/vmlinuz-{release}"));
    let complete = vmlinuz.exists()
        && root
            .join(format!("lib/modules/{release}/modules.dep"))
            .exists();
    complete.then_some(Kernel {
        release,
        vmlinuz,
        root,
    })
}

/// Refreshes the private package lists for `line`'s suite and names its newest generic kernel
/// image package.
fn newest_image(apt: &PrivateApt, line: &Line) -> Result<String> {
    // The archive this machine installs from serves every suite of the matrix.
    let mirror = apt_sources::debian_mirror(&apt_sources::codename()?)?;
    fs::write(
        apt.sources_list(),
        format!("deb {mirror} {} main\n", line.suite),
    )?;
    run(apt.command("apt-get").args(["-q", "update"]))?;
    let prefix = format!("linux-image-{}.", line.version);
    let found = output(apt.command("apt-cache").args([
        "search",
        "--names-only",
        &format!("^{}", prefix.replace('.', "\\.")),
    ]))?;
    found
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| is_generic_image(name, line.version, line.arch))
        .max_by_key(|name| version_key(name))
        .map(str::to_string)
        .with_context(|| {
            format!(
                "no linux-image-{}.*-{} in {}",
                line.version, line.arch.debian, line.suite
            )
        })
}

/// `linux-image-5.10.0-32-amd64` or `linux-image-6.12.117+deb13-arm64`; not the cloud, rt, dbg,
/// 16k-page or unsigned variants, nor the metapackages.
fn is_generic_image(name: &str, version: &str, arch: Arch) -> bool {
    let Some(stem) = name
        .strip_prefix("linux-image-")
        .and_then(|n| n.strip_suffix(&format!("-{}", arch.debian)))
    else {
        return false;
    };
    stem.starts_with(&format!("{version}."))
        && stem
            .replace("deb", "")
            .chars()
            .all(|c| c.is_ascii_digit() || ".-+".contains(c))
}

/// The numbers of a package name in order, which sort its versions: 5.10.0-32 before 5.10.0-33.
fn version_key(name: &str) -> Vec<u64> {
    name.split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse().ok())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_generic_images_only() {
        let amd64 = arch::AMD64;
        assert!(is_generic_image(
            "linux-image-5.10.0-32-amd64",
            "5.10",
            amd64
        ));
        assert!(is_generic_image(
            "linux-image-6.12.117+deb13-amd64",
            "6.12",
            amd64
        ));
        assert!(!is_generic_image(
            "linux-image-5.10.0-32-cloud-amd64",
            "5.10",
            amd64
        ));
        assert!(!is_generic_image(
            "linux-image-5.10.0-32-rt-amd64",
            "5.10",
            amd64
        ));
        assert!(!is_generic_image(
            "linux-image-5.10.0-32-amd64-dbg",
            "5.10",
            amd64
        ));
        assert!(!is_generic_image(
            "linux-image-6.1.0-50-amd64",
            "6.12",
            amd64
        ));
        assert!(is_generic_image(
            "linux-image-6.1.0-50-arm64",
            "6.1",
            arch::ARM64
        ));
        assert!(!is_generic_image(
            "linux-image-6.1.0-50-arm64-16k",
            "6.1",
            arch::ARM64
        ));
        assert!(!is_generic_image(
            "linux-image-6.1.0-50-arm64",
            "6.1",
            amd64
        ));
        assert!(
            version_key("linux-image-5.10.0-33-amd64") > version_key("linux-image-5.10.0-9-amd64")
        );
    }
}
