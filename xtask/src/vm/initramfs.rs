//! The guest's initramfs: a static busybox, the modules 9p needs (taken from the guest kernel's
//! own package), and an /init that mounts the host's root and hands over to stage 2.
//!
//! It is an uncompressed newc cpio written here: the kernel unpacks that as an initrd directly, and
//! no cpio or gzip tool is needed on the host.

use std::{
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};

use super::kernels::Kernel;
use crate::output;

/// Modules that reach the host's root: the virtio PCI transport, 9p over virtio, the 9p
/// filesystem. modprobe resolves what they depend on; built-in ones need nothing.
const ROOT_MODULES: [&str; 3] = ["virtio_pci", "9pnet_virtio", "9p"];

/// Where the static busybox may be (merged /usr or not).
const BUSYBOX: [&str; 2] = ["/usr/bin/busybox", "/bin/busybox"];

/// The first stage. Any failure says what failed on the console (the runner reports it) and
/// powers off at once rather than leaving a guest that waits for the timeout.
const INIT: &str = r#"#!/bin/busybox sh
# /init of capture's VM initramfs, written by `cargo xtask vm`.
/bin/busybox --install -s /bin
fail() { echo "capture-vm: $*"; poweroff -f; sleep 30; }
mount -t proc proc /proc || fail "cannot mount /proc"
mount -t sysfs sys /sys || fail "cannot mount /sys"
mount -t devtmpfs dev /dev || fail "cannot mount /dev"
while read -r m; do
    insmod "/mods/$m" || fail "insmod $m failed"
done < /mods.list
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose hostroot /newroot \
    || fail "cannot mount the host root over 9p"
workspace=
stage2=
shares=
for word in $(cat /proc/cmdline); do
    case "$word" in
        capture.stage2=*) stage2="${word#capture.stage2=}" ;;
        capture.workspace=*) workspace="${word#capture.workspace=}" ;;
        capture.share=*) shares="$shares ${word#capture.share=}" ;;
    esac
done
[ -n "$stage2" ] || fail "no capture.stage2= on the kernel command line"
# The guest's /tmp is its own; a workspace under the host's /tmp (a CI clone) stays visible.
case "$shares:$workspace" in
    :/tmp/*)
        mkdir -p /workspace
        mount --bind "/newroot$workspace" /workspace || fail "cannot keep $workspace"
        ;;
esac
mount -t tmpfs tmp /newroot/tmp || fail "cannot mount a tmpfs on /tmp"
if [ -d /workspace ]; then
    mkdir -p "/newroot$workspace"
    mount --move /workspace "/newroot$workspace" || fail "cannot move $workspace back"
fi
# A root other than the host's (another architecture's) gets the workspace and the build
# directory as shares of their own (`capture.share=TAG:PATH`), each at its path.
for share in $shares; do
    tag="${share%%:*}"
    at="/newroot${share#*:}"
    mkdir -p "$at" 2>/dev/null
    mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000,cache=loose "$tag" "$at" \
        || fail "cannot mount the share $tag at $at over 9p"
done
mkdir -p /newroot/tmp/kroot
mount -t 9p -o trans=virtio,version=9p2000.L,ro,msize=512000 kroot /newroot/tmp/kroot \
    || fail "cannot mount the guest kernel's module tree"
mount -t proc proc /newroot/proc || fail "cannot mount /proc in the new root"
mount --move /sys /newroot/sys || fail "cannot move /sys"
mount --move /dev /newroot/dev || fail "cannot move /dev"
exec switch_root /newroot /bin/bash "$stage2"
fail "switch_root failed"
"#;

/// Writes the initramfs for `kernel` to `out`, with the static busybox of the guest's
/// architecture: this machine's, or the one in the guest's own root.
pub fn build(kernel: &Kernel, guest_root: Option<&Path>, out: &Path) -> Result<()> {
    let busybox = match guest_root {
        None => BUSYBOX
            .iter()
            .map(PathBuf::from)
            .find(|p| p.exists())
            .context("no busybox (the busybox-static package) on the host")?,
        Some(root) => BUSYBOX
            .iter()
            .map(|p| root.join(p.trim_start_matches('/')))
            .find(|p| p.exists())
            .with_context(|| format!("no static busybox in the guest root {}", root.display()))?,
    };
    let mut cpio = Cpio::default();
    for dir in ["bin", "dev", "proc", "sys", "newroot", "mods"] {
        cpio.dir(dir);
    }
    // The kernel opens /dev/console for init's stdio before init runs.
    cpio.char_dev("dev/console", 5, 1);
    cpio.file("bin/busybox", 0o755, &fs::read(&busybox)?);
    let mut list = String::new();
    for path in module_closure(kernel)? {
        let (name, data) = module(&path)?;
        cpio.file(&format!("mods/{name}"), 0o644, &data);
        list.push_str(&name);
        list.push('\n');
    }
    cpio.file("mods.list", 0o644, list.as_bytes());
    cpio.file("init", 0o755, INIT.as_bytes());
    fs::write(out, cpio.finish()).with_context(|| format!("writing {}", out.display()))
}

/// The module files to load, in load order, each once.
fn module_closure(kernel: &Kernel) -> Result<Vec<String>> {
    let mut paths: Vec<String> = Vec::new();
    for module in ROOT_MODULES {
        let deps = output(Command::new("modprobe").arg("-d").arg(&kernel.root).args([
            "-S",
            &kernel.release,
            "--show-depends",
            module,
        ]))?;
        for line in deps.lines() {
            let mut words = line.split_whitespace();
            match (words.next(), words.next()) {
                (Some("insmod"), Some(path)) if !paths.iter().any(|p| p == path) => {
                    paths.push(path.to_string());
                }
                (Some("insmod" | "builtin"), _) => {}
                _ => bail!("unexpected modprobe --show-depends line: {line}"),
            }
        }
    }
    Ok(paths)
}

/// A module's file name without compression suffix, and its uncompressed contents (the
/// initramfs's busybox insmod cannot be relied on to decompress).
fn module(path: &str) -> Result<(String, Vec<u8>)> {
    let file = Path::new(path)
        .file_name()
        .context("module path without a file name")?
        .to_string_lossy()
        .into_owned();
    let unpack = |tool: &str, args: &[&str]| -> Result<Vec<u8>> {
        let out = Command::new(tool)
            .args(args)
            .arg(path)
            .output()
            .with_context(|| format!("running {tool} on {path}"))?;
        if !out.status.success() {
            bail!("{tool} {path} failed");
        }
        Ok(out.stdout)
    };
    if let Some(name) = file.strip_suffix(".xz") {
        Ok((name.to_string(), unpack("xz", &["-dc"])?))
    } else if let Some(name) = file.strip_suffix(".zst") {
        Ok((name.to_string(), unpack("zstd", &["-dcq"])?))
    } else {
        Ok((file, fs::read(path)?))
    }
}

/// A newc ("070701") cpio archive in memory.
#[derive(Default)]
struct Cpio {
    out: Vec<u8>,
    next_ino: u32,
}

impl Cpio {
    fn dir(&mut self, name: &str) {
        self.entry(name, 0o040_755, 2, (0, 0), &[]);
    }

    fn file(&mut self, name: &str, perm: u32, data: &[u8]) {
        self.entry(name, 0o100_000 | perm, 1, (0, 0), data);
    }

    fn char_dev(&mut self, name: &str, major: u32, minor: u32) {
        self.entry(name, 0o020_600, 1, (major, minor), &[]);
    }

    fn finish(mut self) -> Vec<u8> {
        self.entry("TRAILER!!!", 0, 1, (0, 0), &[]);
        self.out
    }

    fn entry(&mut self, name: &str, mode: u32, nlink: u32, rdev: (u32, u32), data: &[u8]) {
        self.next_ino += 1;
        let fields = [
            self.next_ino,
            mode,
            0, // uid
            0, // gid
            nlink,
            0, // mtime
            u32::try_from(data.len()).expect("initramfs member over 4 GiB"),
            0, // dev major
            0, // dev minor
            rdev.0,
            rdev.1,
            u32::try_from(name.len() + 1).expect("short name"),
            0, // check (unused by newc)
        ];
        self.out.extend_from_slice(b"070701");
        for field in fields {
            self.out
                .extend_from_slice(format!("{field:08x}").as_bytes());
        }
        self.out.extend_from_slice(name.as_bytes());
        self.out.push(0);
        self.pad();
        self.out.extend_from_slice(data);
        self.pad();
    }

    /// Header+name and data each end on a four-byte boundary.
    fn pad(&mut self) {
        while !self.out.len().is_multiple_of(4) {
            self.out.push(0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpio_entries_are_aligned_newc() {
        let mut cpio = Cpio::default();
        cpio.file("init", 0o755, b"#!/bin/sh\n");
        let out = cpio.finish();
        assert_eq!(&out[..6], b"070701");
        // mode field (second) of the first entry
        assert_eq!(&out[14..22], b"000081ed");
        // 110-byte header + "init\0" padded to 116, then 10 bytes of data padded to 12.
        assert_eq!(&out[110..115], b"init\0");
        assert_eq!(&out[116..126], b"#!/bin/sh\n");
        assert_eq!(&out[128..134], b"070701");
        assert_eq!(out.len() % 4, 0);
        assert!(out.windows(10).any(|w| w == b"TRAILER!!!"));
    }
}
