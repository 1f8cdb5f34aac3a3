//! The builds the tests run: this tree's binaries, and two other builds of `capture` that the
//! upgrade tests take a node to and back: the next-layout variant of this tree, and the previous
//! release from the git history.
//!
//! All three share one target directory, so that each dependency compiles once: the variant
//! differs by a feature (`capture-user/layout-next`) and the previous release by its package
//! paths, so their own crates sit beside this tree's. Only the uplifted `target/<profile>/capture`
//! is one file for all three: each other build's binary is moved to `target/<build>/<profile>/`
//! as soon as it is built, and this tree's build comes last, which puts its own back.

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

/// The profile every build here uses (the tests find the other builds under it).
const PROFILE: &str = "debug";

/// `cargo` arguments that build the `capture` binary alone.
const BUILD_CAPTURE: [&str; 6] = ["build", "--locked", "-p", "capture", "--bin", "capture"];

/// The same in `PREVIOUS_RELEASE`'s tree, where the binary was capture-user's.
const BUILD_PREVIOUS_CAPTURE: [&str; 6] = [
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

/// Where the kernel programs of every debug configuration are built (capture-user's build.rs):
/// the BPF target's `core` once, not once per configuration.
pub fn ebpf_target_dir() -> Result<PathBuf> {
    Ok(std::path::absolute(target_dir().join("ebpf"))?)
}

/// Every build the tests run: the variant and the previous release, then this tree's binaries.
pub fn build_all() -> Result<()> {
    build_variant()?;
    build_previous_release()?;
    build()
}

/// `capture` alone, without the test-only switches (so with the command line a release has); the
/// binary's path.
pub fn build_capture() -> Result<PathBuf> {
    run(cargo().args(BUILD_CAPTURE))?;
    Ok(target_dir().join(PROFILE).join("capture"))
}

/// Every binary of this tree, with the test-only switches.
pub fn build() -> Result<()> {
    run(cargo()
        .args(["build", "--bins", "--locked"])
        .args(TEST_FEATURES))
}

/// `capture` with the next map layouts (capture-common's `layout` module), as
/// `target/variant/<profile>/capture`.
fn build_variant() -> Result<()> {
    run(cargo()
        .args(BUILD_CAPTURE)
        .args(TEST_FEATURES)
        .args(["--features", "capture-user/layout-next"]))?;
    set_aside("variant")
}

/// The variant as a release build, for the benchmark's takeover: its path,
/// `target/variant/release/capture`.
pub fn build_release_variant() -> Result<PathBuf> {
    run(cargo()
        .args(BUILD_CAPTURE)
        .args(["--release", "--features", "capture-user/layout-next"]))?;
    let built = target_dir().join("release").join("capture");
    let dir = target_dir().join("variant").join("release");
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let to = dir.join("capture");
    std::fs::rename(&built, &to)
        .with_context(|| format!("moving {} to {}", built.display(), to.display()))?;
    Ok(std::path::absolute(to)?)
}

/// `capture` of `PREVIOUS_RELEASE`, from this repository's history, as
/// `target/previous/<profile>/capture`.
fn build_previous_release() -> Result<()> {
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
    // Built from its own workspace (under this one, so that .cargo/config.toml's profile applies
    // to it too) into this target directory.
    run(cargo()
        .current_dir(&src)
        .env("CARGO_TARGET_DIR", std::path::absolute(target_dir())?)
        .args(BUILD_PREVIOUS_CAPTURE)
        .args(TEST_FEATURES))?;
    set_aside("previous")
}

/// Moves the `capture` just built to `target/<build>/<profile>/capture`, out of the way of this
/// tree's, which the next `build()` puts back in its place.
fn set_aside(build: &str) -> Result<()> {
    let built = target_dir().join(PROFILE).join("capture");
    let dir = target_dir().join(build).join(PROFILE);
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    let to = dir.join("capture");
    std::fs::rename(&built, &to)
        .with_context(|| format!("moving {} to {}", built.display(), to.display()))
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
