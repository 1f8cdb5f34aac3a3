//! Files taken from the machine that builds an image.

use std::{io, path::Path, process::Command};

/// What `ldd` says `binary` loads, by the paths the dynamic loader uses (the loader itself
/// included). Empty for a static binary.
pub fn shared_libraries(binary: &Path) -> io::Result<Vec<String>> {
    let out = Command::new("ldd").arg(binary).output()?;
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    // ldd fails on a static binary, saying so (on stdout or stderr, by version).
    if format!("{stdout}{stderr}").contains("not a dynamic executable") {
        return Ok(Vec::new());
    }
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "ldd {}: {}",
            binary.display(),
            stderr.trim()
        )));
    }
    Ok(stdout
        .lines()
        .filter_map(|line| {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux… (0x…)`;
            // the vDSO has no file. `statically linked` names none either.
            let path = line.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| path.to_string())
        })
        .collect())
}
