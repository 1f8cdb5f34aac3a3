//! Boots one kernel in qemu and streams its serial console.
//!
//! TCG only: KVM inside these (already virtual) machines hangs. An amd64 guest sees the host's
//! root read-only over 9p (`hostroot`), so bash, iproute2, iptables and the test binaries run
//! unchanged; an arm64 guest sees a root of arm64 Debian packages there instead (`guest_root.rs`)
//! and the workspace, with its cross-built test binaries, as a share of its own. Both see the
//! unpacked kernel package (`kroot`) for its modules. They have no network card: the tests build
//! their own network from veth pairs in namespaces.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

use super::{
    console::{stream, Console, Ended, Guard},
    kernels::Kernel,
};
use crate::image::arch::{self, Arch};

/// What one VM boots: a kernel, its initramfs, and the root stage 2 runs on.
pub struct Guest {
    pub kernel: Kernel,
    pub initrd: PathBuf,
    pub arch: Arch,
    /// This machine's root (`/`) for its own architecture; another's tree of Debian packages
    /// (`guest_root.rs`), with the workspace shared beside it.
    pub root: PathBuf,
}

impl Guest {
    fn own_root(&self) -> bool {
        self.root == Path::new("/")
    }
}

/// Boots `guest`, running `stage2`, until it powers off or `deadline` passes.
/// Returns whether it timed out (qemu is killed then).
pub fn boot(
    guest: &Guest,
    stage2: &Path,
    deadline: Instant,
    console: &mut Console,
) -> Result<bool> {
    let stage2 = stage2.to_string_lossy().into_owned();
    let workspace = super::workspace_root();
    let mut shares = vec![
        (guest.root.clone(), "hostroot".to_string()),
        (guest.kernel.root.clone(), "kroot".to_string()),
    ];
    let (program, machine) = emulator(guest.arch);
    let mut append = format!(
        "{} panic=-1 quiet mitigations=off capture.stage2={stage2} capture.workspace={}",
        machine.kernel_args,
        workspace.display()
    );
    if !guest.own_root() {
        for (i, dir) in guest_shares(&workspace)?.into_iter().enumerate() {
            let tag = format!("share{i}");
            append.push_str(&format!(" capture.share={tag}:{}", dir.display()));
            shares.push((dir, tag));
        }
    }
    // The kernel command line is split at spaces and -virtfs options at commas.
    let unfit = |p: &Path| p.to_string_lossy().contains([',', ' ', '\t', '\n', ':']);
    if stage2.contains(char::is_whitespace) || shares.iter().any(|(p, _)| unfit(p)) {
        bail!("the paths {stage2}, {shares:?} must have no spaces, commas or colons");
    }
    let (reader, writer) = std::io::pipe()?;
    let child = {
        let mut cmd = Command::new(program);
        cmd.args(machine.args)
            .args(["-accel", "tcg,thread=single", "-smp", "2"])
            .args(["-m", "2048", "-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(&guest.kernel.vmlinuz)
            .arg("-initrd")
            .arg(&guest.initrd)
            .arg("-append")
            .arg(append);
        for (path, tag) in &shares {
            cmd.arg("-virtfs").arg(virtfs(&path.to_string_lossy(), tag));
        }
        cmd.stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer);
        // `cmd` (and its copies of the pipe's write end) is dropped at the end of this block, so
        // the reader sees EOF when qemu exits.
        cmd.spawn().with_context(|| format!("starting {program}"))?
    };
    let mut guard = Guard(child);
    let timed_out = matches!(
        stream(&mut guard.0, reader, deadline, console)?,
        Ended::TimedOut
    );
    if timed_out {
        console.note(&format!(
            "timed out after {:.0} s: killed qemu",
            console.elapsed()
        ))?;
    }
    Ok(timed_out)
}

/// What a guest on a root of its own sees of this machine besides: the workspace (stage 2's
/// scripts, the tests' data) and the build directory (the test binaries and what they start)
/// where it is not inside the workspace.
pub fn guest_shares(workspace: &Path) -> Result<Vec<PathBuf>> {
    let target = std::path::absolute(crate::builds::target_dir())?;
    let mut dirs = vec![workspace.to_path_buf()];
    if !target.starts_with(workspace) {
        dirs.push(target);
    }
    Ok(dirs)
}

/// How qemu emulates one architecture's machine.
struct Machine {
    args: &'static [&'static str],
    kernel_args: &'static str,
}

/// The qemu program and machine for `arch`.
fn emulator(arch: Arch) -> (&'static str, Machine) {
    if arch == arch::ARM64 {
        (
            "qemu-system-aarch64",
            Machine {
                // `pauth-impdef`: pointer authentication with qemu's own cheap hash instead of
                // the architected QARMA cipher, which qemu's documentation names as slow to
                // emulate (Debian's arm64 kernels sign every return address).
                args: &["-M", "virt", "-cpu", "max,pauth-impdef=on"],
                // The virt machine's PL011 UART.
                kernel_args: "console=ttyAMA0",
            },
        )
    } else {
        (
            "qemu-system-x86_64",
            Machine {
                args: &["-cpu", "max"],
                // Without a trusted TSC the guest's clock is an emulated HPET, which every time
                // read pays for; 5.10 ran a short binary 20% faster with `mitigations=off` (a
                // guest thrown away after its run needs no speculation barriers) and these.
                kernel_args: "console=ttyS0 tsc=reliable clocksource=tsc",
            },
        )
    }
}

fn virtfs(path: &str, tag: &str) -> String {
    format!("local,path={path},mount_tag={tag},security_model=none,readonly=on,multidevs=remap")
}
