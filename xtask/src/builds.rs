//! The builds the tests run: this tree's binaries, and two other builds of `capture` that the
//! upgrade tests take a node to and back: the next-layout variant of this tree, and the previous
//! release from the git history.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, run, TEST_FEATURES};

/// The last commit before builds pinned under `builds/<object id>` and took nodes over in place:
/// the release an operator upgrades from. Its pins sit at the top of the bpffs directory and its
/// node record names no layouts.
pub const PREVIOUS_RELEASE: &str = "e293887832a27a4329a7b1687c88fb9a080f08bf";

/// `cargo` arguments that build the `capture` binary alone.
const BUILD_CAPTURE: [&str; 6] = [
    "build",
    "--locked",
    "-p",
    "capture-user",
    "--bin",
    "capture",
];

pub fn target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR").map_or_else(|| PathBuf::from("target"), Into::into)
}

/// Every binary of this tree, with the test-only switches.
pub fn build() -> Result<()> {
    run(cargo()
        .args(["build", "--bins", "--locked"])
        .args(TEST_FEATURES))
}

/// `capture` with the next map layouts (capture-common's `layout` module), in its own target
/// directory (`target/variant`).
pub fn build_variant() -> Result<()> {
    run(cargo()
        .env("CAPTURE_LAYOUT_VARIANT", "next")
        .env("CARGO_TARGET_DIR", target_dir().join("variant"))
        .args(BUILD_CAPTURE)
        .args(TEST_FEATURES))
}

/// `capture` of `PREVIOUS_RELEASE`, from this repository's history, into
/// `target/previous/<profile>/capture`.
pub fn build_previous_release() -> Result<()> {
    let out = target_dir().join("previous");
    let src = out.join("src");
    let stamp = src.join(".commit");
    if std::fs::read_to_string(&stamp).ok().as_deref() != Some(PREVIOUS_RELEASE) {
        let known = Command::new("git")
            .args(["cat-file", "-e", &format!("{PREVIOUS_RELEASE}^{{commit}}")])
            .stderr(Stdio::null())
            .status()
            .context("running git")?;
        if !known.success() {
            bail!("this clone lacks commit {PREVIOUS_RELEASE} (the previous release, which the upgrade test starts from); clone the repository with its history (not --depth), or run `git fetch --unshallow`");
        }
        let _ = std::fs::remove_dir_all(&src);
        std::fs::create_dir_all(&src).with_context(|| format!("creating {}", src.display()))?;
        extract(PREVIOUS_RELEASE, &src)?;
        std::fs::write(&stamp, PREVIOUS_RELEASE)?;
    }
    run(cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", std::path::absolute(&out)?)
        .args(BUILD_CAPTURE)
        .args(TEST_FEATURES))
}

/// The tree of `commit`, written into `dir` (git archive | tar).
fn extract(commit: &str, dir: &Path) -> Result<()> {
    let mut archive = Command::new("git")
        .args(["archive", "--format=tar", commit])
        .stdout(Stdio::piped())
        .spawn()
        .context("running git archive")?;
    let tar = Command::new("tar")
        .arg("-x")
        .arg("-C")
        .arg(dir)
        .stdin(archive.stdout.take().expect("piped"))
        .status()
        .context("running tar")?;
    let archived = archive.wait()?;
    if !archived.success() || !tar.success() {
        bail!("extracting {commit} into {} failed", dir.display());
    }
    Ok(())
}
