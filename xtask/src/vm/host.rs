//! `--kernels host`: the same test binaries on this machine's own kernel, without a VM. Their
//! output is framed with the same `capture-vm:` lines stage 2 prints, so results.rs reads both
//! logs alike.

use std::{
    fs,
    path::Path,
    process::{Command, Stdio},
    time::Instant,
};

use anyhow::{Context as _, Result};

use super::{
    console::{stream, Console, Ended, Guard},
    model::TestBinary,
};

/// Runs `binaries` in `tests_dir` until done or `deadline`. Returns whether it timed out.
pub fn run(
    binaries: &[&TestBinary],
    filter: &[String],
    tests_dir: &Path,
    deadline: Instant,
    console: &mut Console,
) -> Result<bool> {
    let release = fs::read_to_string("/proc/sys/kernel/osrelease")?;
    console.line(&format!("capture-vm: kernel {}", release.trim()))?;
    let skips = std::env::temp_dir().join(format!("capture-skips-{}", std::process::id()));
    fs::write(&skips, "")?;
    let cache = crate::testing::TestCache::new()?;
    let timed_out = run_binaries(
        binaries, filter, tests_dir, &skips, &cache, deadline, console,
    );
    let _ = fs::remove_file(&skips);
    if timed_out? {
        return Ok(true);
    }
    console.line("capture-vm: done")?;
    Ok(false)
}

fn run_binaries(
    binaries: &[&TestBinary],
    filter: &[String],
    tests_dir: &Path,
    skips: &Path,
    cache: &crate::testing::TestCache,
    deadline: Instant,
    console: &mut Console,
) -> Result<bool> {
    for binary in binaries {
        console.line(&format!("capture-vm: begin {}", binary.name))?;
        let (reader, writer) = std::io::pipe()?;
        let child = {
            let mut cmd = Command::new(&binary.path);
            cmd.args(binary.run_args(filter))
                .current_dir(tests_dir)
                .env("CAPTURE_SKIP_LOG", skips)
                .env(crate::testing::TestCache::VAR, cache.path())
                .stdin(Stdio::null())
                .stdout(writer.try_clone()?)
                .stderr(writer);
            // Dropping `cmd` here closes our copies of the write end.
            cmd.spawn()
                .with_context(|| format!("starting {}", binary.path.display()))?
        };
        let mut guard = Guard(child);
        match stream(&mut guard.0, reader, deadline, console)? {
            Ended::Exited(rc) => {
                console.line(&format!("capture-vm: end {} rc={rc}", binary.name))?;
                // As stage 2 does: this binary's skips right after its end line.
                for line in fs::read_to_string(skips).unwrap_or_default().lines() {
                    console.line(&format!("capture-skip: {line}"))?;
                }
                fs::write(skips, "")?;
            }
            Ended::TimedOut => {
                console.note(&format!(
                    "timed out after {:.0} s in {}: killed it",
                    console.elapsed(),
                    binary.name
                ))?;
                return Ok(true);
            }
        }
    }
    Ok(false)
}
