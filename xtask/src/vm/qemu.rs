//! Boots one kernel in qemu and streams its serial console.
//!
//! TCG only: KVM inside these (already virtual) machines hangs. The guest sees the host's root
//! read-only over 9p (`hostroot`), so bash, iproute2, iptables and the test binaries run unchanged,
//! and the unpacked kernel package (`kroot`) for its modules. It has no network card: the tests
//! build their own network from veth pairs in namespaces.

use std::{
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{bail, Context as _, Result};

use super::{
    console::{stream, Console, Ended, Guard},
    kernels::Kernel,
};

/// Boots `kernel` with `initrd`, running `stage2`, until it powers off or `deadline` passes.
/// Returns whether it timed out (qemu is killed then).
pub fn boot(
    kernel: &Kernel,
    initrd: &Path,
    stage2: &Path,
    deadline: Instant,
    console: &mut Console,
) -> Result<bool> {
    let stage2 = stage2.to_string_lossy();
    let kroot = kernel.root.to_string_lossy();
    // The kernel command line is split at spaces and -virtfs options at commas.
    if stage2.contains(char::is_whitespace) || kroot.contains(',') {
        bail!("the paths {stage2} and {kroot} must have no spaces or commas");
    }
    let (reader, writer) = std::io::pipe()?;
    let child = {
        let mut cmd = Command::new("qemu-system-x86_64");
        cmd.args(["-accel", "tcg,thread=single", "-cpu", "max", "-smp", "2"])
            .args(["-m", "2048", "-nographic", "-no-reboot", "-nic", "none"])
            .arg("-kernel")
            .arg(&kernel.vmlinuz)
            .arg("-initrd")
            .arg(initrd)
            .arg("-append")
            // `mitigations=off tsc=reliable`: a guest thrown away after its run needs no
            // speculation barriers, and without a trusted TSC its clock is an emulated HPET,
            // which every time read pays for; 5.10 ran a short binary 20% faster with both.
            .arg(format!(
                "console=ttyS0 panic=-1 quiet mitigations=off tsc=reliable clocksource=tsc capture.stage2={stage2} capture.workspace={}",
                super::workspace_root().display()
            ))
            .arg("-virtfs")
            .arg(virtfs("/", "hostroot"))
            .arg("-virtfs")
            .arg(virtfs(&kroot, "kroot"))
            .stdin(Stdio::null())
            .stdout(writer.try_clone()?)
            .stderr(writer);
        // `cmd` (and its copies of the pipe's write end) is dropped at the end of this block, so
        // the reader sees EOF when qemu exits.
        cmd.spawn().context("starting qemu-system-x86_64")?
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

fn virtfs(path: &str, tag: &str) -> String {
    format!("local,path={path},mount_tag={tag},security_model=none,readonly=on,multidevs=remap")
}
