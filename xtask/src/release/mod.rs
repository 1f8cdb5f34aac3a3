//! `cargo xtask release --out DIR`: everything a release publishes, in one directory.
//!
//! - `capture-<version>.oci.tar`: the node agent's image (`cargo xtask image`);
//! - `bin/capture-<version>-linux-<arch>` and `bin/capture-cni-…`: the static binaries each
//!   platform's image holds (amd64 and arm64), each carrying its dependency list
//!   (cargo-auditable);
//! - `share/`: man pages and shell completions (`capture generate-docs`);
//! - `manifests/`: deploy/'s files, the DaemonSet's image named by tag and digest;
//! - `capture-<version>.cdx.json`: the SBOM (sbom.rs);
//! - `RELEASE-NOTES.md`: the CHANGELOG's section for the version;
//! - `SHA256SUMS`: every other file's digest, as `sha256sum -c` reads it.
//!
//! Nothing here needs the network: signing (cosign) happens where the release is published
//! (docs/using/install.md).

mod notes;
mod sbom;
mod sums;

use std::path::{Path, PathBuf};

use anyhow::{bail, Context as _, Result};

use crate::{image, run};

pub struct Options {
    pub out: PathBuf,
    /// Where the release's image is pushed (`registry.example/capture`): the manifests name it.
    pub repository: String,
}

impl Options {
    /// The release `cargo xtask test` writes for its tests to check, under the target directory.
    pub fn for_tests() -> Self {
        Self {
            out: crate::builds::target_dir().join("dist/release"),
            repository: image::REPOSITORY.to_string(),
        }
    }
}

/// Writes the release into `opts.out` (a previous release there is replaced; any other content
/// is refused, never deleted) and returns the image's build. The release is written beside
/// `out` first and moved into place whole, so an interrupted run leaves the previous release (or
/// nothing) at `out`, never half of one.
pub fn write(opts: &Options) -> Result<image::Built> {
    let out = &opts.out;
    check_out(out)?;
    let staging = staging_dir(out)?;
    let built = fill(&staging, opts)?;
    replace(out, &staging)?;
    println!("release: {}", out.display());
    Ok(built)
}

/// Writes every file of the release into `out`, an empty directory.
fn fill(out: &Path, opts: &Options) -> Result<image::Built> {
    let built = image::build(&image::Options { out: None })?;
    let version = &built.version;
    if version.contains("-dev.") {
        println!(
            "release: {version} is a development build (HEAD is not tagged v{}); a release is \
             cut from the tagged commit",
            env!("CARGO_PKG_VERSION")
        );
    }
    copy_out(
        &built.archive,
        &out.join(format!("capture-{version}.oci.tar")),
    )?;
    for platform in &built.platforms {
        for binary in &platform.binaries {
            let name = binary
                .file_name()
                .and_then(|n| n.to_str())
                .unwrap_or_default();
            copy_out(
                binary,
                &out.join("bin")
                    .join(format!("{name}-{version}-linux-{}", platform.arch.oci)),
            )?;
        }
    }
    run(std::process::Command::new(&built.host().binaries[0])
        .arg("generate-docs")
        .arg("--out")
        .arg(out.join("share")))?;
    write_manifests(&out.join("manifests"), &opts.repository, &built)?;
    let bom = sbom::generate(&built)?;
    std::fs::write(out.join(format!("capture-{version}.cdx.json")), bom)?;
    let changelog = std::fs::read_to_string("CHANGELOG.md").context("reading CHANGELOG.md")?;
    std::fs::write(
        out.join("RELEASE-NOTES.md"),
        notes::release_notes(&changelog, version, &built)?,
    )?;
    sums::write(out)?;
    Ok(built)
}

/// Refuses an `out` that holds anything but a release (`--out ~` must not cost a home
/// directory); deletes nothing.
fn check_out(out: &Path) -> Result<()> {
    let holds_anything = std::fs::read_dir(out).is_ok_and(|mut d| d.next().is_some());
    if holds_anything && !out.join(sums::FILE).is_file() {
        bail!(
            "{} is not empty and holds no release (no {}): give --out an empty or new directory",
            out.display(),
            sums::FILE
        );
    }
    Ok(())
}

/// `.<name>.partial` beside `out`, empty with `bin/`: what an interrupted run left there is this
/// task's own and goes.
fn staging_dir(out: &Path) -> Result<PathBuf> {
    let name = out
        .file_name()
        .with_context(|| format!("--out {} names no directory", out.display()))?;
    let staging = out.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    if staging.exists() {
        std::fs::remove_dir_all(&staging)
            .with_context(|| format!("removing {}", staging.display()))?;
    }
    std::fs::create_dir_all(staging.join("bin"))?;
    Ok(staging)
}

/// Puts the finished release at `out`, in place of the previous one.
fn replace(out: &Path, staging: &Path) -> Result<()> {
    check_out(out)?;
    if out.exists() {
        std::fs::remove_dir_all(out)
            .with_context(|| format!("replacing the release in {}", out.display()))?;
    }
    std::fs::rename(staging, out)
        .with_context(|| format!("moving {} to {}", staging.display(), out.display()))
}

/// deploy/'s files, with the DaemonSet's image named `repository:version@digest`.
fn write_manifests(dir: &Path, repository: &str, built: &image::Built) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let reference = format!("{repository}:{}@{}", built.version, built.digest);
    for entry in std::fs::read_dir("deploy").context("reading deploy/")? {
        let path = entry?.path();
        let Some(name) = path.file_name().and_then(|n| n.to_str()) else {
            continue;
        };
        let text = std::fs::read_to_string(&path)?;
        let text = if name == "capture.yaml" {
            with_image(&text, &reference)?
        } else {
            text
        };
        std::fs::write(dir.join(name), text)?;
    }
    Ok(())
}

/// `manifest` with every `image: localhost/capture:…` line naming `reference` instead.
fn with_image(manifest: &str, reference: &str) -> Result<String> {
    let prefix = format!("image: {}:", image::REPOSITORY);
    let mut replaced = 0;
    let lines: Vec<String> = manifest
        .lines()
        .map(|line| match line.find(&prefix) {
            // Only the key itself, after its indent or a list item's dash.
            Some(at) if line[..at].trim_start_matches([' ', '-']).is_empty() => {
                replaced += 1;
                format!("{}image: {reference}", &line[..at])
            }
            _ => line.to_string(),
        })
        .collect();
    if replaced == 0 {
        bail!("deploy/capture.yaml names no `{prefix}…` image to pin");
    }
    Ok(lines.join("\n") + "\n")
}

/// A copy, never a link: a build that later rewrote its output in place (a linker, an archive
/// writer) would change a linked file after its checksum was published.
fn copy_out(from: &Path, to: &Path) -> Result<()> {
    std::fs::copy(from, to)
        .with_context(|| format!("copying {} to {}", from.display(), to.display()))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_image_of_the_repository_is_pinned_and_nothing_else_moves() {
        let manifest = "spec:\n  initContainers:\n    - image: localhost/capture:0.2.0\n      \
                        name: install\n  containers:\n    - name: agent\n      image: \
                        localhost/capture:0.2.0\n    - image: other/sidecar:1\n";
        let pinned = with_image(manifest, "reg.example/capture:0.2.0@sha256:ab").unwrap();
        assert_eq!(
            pinned
                .matches("image: reg.example/capture:0.2.0@sha256:ab")
                .count(),
            2
        );
        assert!(
            pinned.contains("    - image: other/sidecar:1\n"),
            "{pinned}"
        );
        assert!(
            pinned.contains("      image: reg.example"),
            "indent kept: {pinned}"
        );
        assert!(with_image("kind: ConfigMap\n", "x").is_err());
    }

    #[test]
    fn only_a_previous_release_is_replaced_anything_else_is_refused() {
        let base = std::env::temp_dir().join(format!("capture-release-out-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&base);
        let dir = base.join("release");
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("notes.txt"), "mine").unwrap();
        let err = check_out(&dir).unwrap_err();
        assert!(err.to_string().contains("holds no release"), "{err}");
        assert!(dir.join("notes.txt").is_file(), "nothing of it deleted");
        std::fs::remove_file(dir.join("notes.txt")).unwrap();
        std::fs::write(dir.join(sums::FILE), "").unwrap();
        std::fs::write(dir.join("capture-0.1.0.oci.tar"), "old").unwrap();
        check_out(&dir).unwrap();
        // An interrupted run's staging directory is taken over; the previous release stays
        // until the new one is whole.
        std::fs::create_dir_all(base.join(".release.partial/half")).unwrap();
        let staging = staging_dir(&dir).unwrap();
        assert!(!staging.join("half").exists() && staging.join("bin").is_dir());
        assert!(dir.join("capture-0.1.0.oci.tar").is_file());
        std::fs::write(staging.join("capture-0.2.0.oci.tar"), "new").unwrap();
        replace(&dir, &staging).unwrap();
        assert!(!dir.join("capture-0.1.0.oci.tar").exists());
        assert!(dir.join("capture-0.2.0.oci.tar").is_file() && !staging.exists());
        std::fs::remove_dir_all(&base).unwrap();
    }
}
