//! `SHA256SUMS`: every file of the release but itself, as `sha256sum -c` reads it.

use std::path::{Path, PathBuf};

use anyhow::{Context as _, Result};

pub const FILE: &str = "SHA256SUMS";

/// Writes `dir/SHA256SUMS` over every other file under `dir`, by path relative to it, sorted.
pub fn write(dir: &Path) -> Result<()> {
    let mut files = Vec::new();
    collect(dir, dir, &mut files)?;
    files.sort();
    let mut sums = String::new();
    for relative in files.iter().filter(|f| f.as_os_str() != FILE) {
        let data = std::fs::read(dir.join(relative))
            .with_context(|| format!("reading {}", relative.display()))?;
        let digest = capture_oci::sha256(&data);
        sums.push_str(&format!("{digest}  {}\n", relative.display()));
    }
    std::fs::write(dir.join(FILE), sums)?;
    Ok(())
}

fn collect(root: &Path, dir: &Path, files: &mut Vec<PathBuf>) -> Result<()> {
    for entry in std::fs::read_dir(dir).with_context(|| format!("reading {}", dir.display()))? {
        let path = entry?.path();
        if path.is_dir() {
            collect(root, &path, files)?;
        } else {
            files.push(path.strip_prefix(root)?.to_path_buf());
        }
    }
    Ok(())
}
