//! `cargo xtask image`: the node agent's container image, for amd64 and arm64 nodes, as one OCI
//! archive that containerd imports (`ctr -n k8s.io images import`, which takes the node's own
//! platform from the index) and skopeo copies to a registry.
//!
//! Written directly (capture-oci) rather than by buildah, umoci or a Docker daemon: the image is
//! one layer of known files per platform, so a writer of sorted, root-owned tar entries stamped
//! with the commit's time is all it takes, every byte follows from the inputs (two builds of one
//! commit give one digest), and nothing beyond what setup already installs is needed. The name
//! points at an image index with one manifest per platform (`linux/amd64`, `linux/arm64/v8`);
//! each platform's layer holds
//! - `capture` and `capture-cni` built for it, linked statically (glibc's `crt-static`; the
//!   other architecture's with Debian's cross compiler), so the capture-cni that `install-cni`
//!   copies into the host's /opt/cni/bin runs whatever the host's libc;
//! - what the agent runs in its container, from that architecture's Debian packages (this
//!   machine's own for its architecture, the packages setup fetches for the other: sources.rs;
//!   their versions are in the image's labels): iptables and ip6tables in both the nft and
//!   the legacy variant (`xtables-nft-multi`, `xtables-legacy-multi`, the names Debian links to
//!   them, and their match and target extensions), `nft` (nftables, for the nftables backend),
//!   `ip` (iproute2) and `nsenter` (util-linux),
//!   with the shared libraries each names (read from its ELF headers: elf.rs);
//! - `/tmp`, `/run` and the merged-/usr links. Nothing else: no shell, no package manager.

pub mod arch;
mod elf;
pub mod layer;
pub mod sources;

use std::{collections::BTreeMap, path::PathBuf, process::Command};

use anyhow::{bail, Context as _, Result};
use capture_oci::{Compression, PlatformImage};
use serde_json::json;

use crate::{cargo, output, run};
use arch::Arch;
use sources::{DebPackage, Source};

/// The repository the image is named under: `localhost/` says it is loaded onto nodes (or
/// pushed under another name), never pulled from a public registry by a short name.
pub const REPOSITORY: &str = "localhost/capture";

/// The workspace crates the static binaries are built from, which a reproducibility check
/// compiles afresh.
const OWN_CRATES: [&str; 5] = [
    "capture-sys",
    "capture-model",
    "capture-user",
    "capture",
    "capture-cni",
];

pub struct Options {
    pub out: Option<PathBuf>,
}

/// Builds the image twice, compiling `capture` and `capture-cni` afresh for the second, and fails
/// unless both archives carry the same digest.
///
/// Neither build writes the archive the tests read (`archive_path`), and the commit is read once,
/// so CI runs this beside the tests.
pub fn check_reproducible() -> Result<()> {
    let commit = Commit::head()?;
    // Each build's digest, its archive removed again.
    let digest_of = |name: &str, kernel: KernelPrograms| -> Result<String> {
        let out = archive_path().with_extension(format!("{name}.tar"));
        let built = build_image(
            &Options {
                out: Some(out.clone()),
            },
            kernel,
            &commit,
        )?;
        std::fs::remove_file(&out)?;
        Ok(built.digest)
    };
    let first = digest_of("first", KernelPrograms::Shared)?;
    for arch in arch::ALL {
        let mut clean = cargo();
        clean.env("CARGO_TARGET_DIR", static_target_dir()).args([
            "clean",
            "--release",
            "--target",
            arch.rust_target,
        ]);
        for krate in OWN_CRATES {
            clean.args(["-p", krate]);
        }
        run(&mut clean)?;
    }
    // The kernel programs too: the first build may have taken them from the shared directory.
    let second = digest_of("second", KernelPrograms::Afresh)?;
    if first != second {
        bail!("two builds of one tree gave two images: {first} and {second}");
    }
    println!("reproducible: both builds are {second}");
    Ok(())
}

/// Where the image's kernel programs come from.
#[derive(Clone, Copy, PartialEq, Eq)]
enum KernelPrograms {
    /// The shared directory every build of this tree compiles them in (`builds::ebpf_target_dir`).
    Shared,
    /// A build of their own, in the static binaries' build directory.
    Afresh,
}

/// What a build of the image made: its name, version and digest, where the archive is, and
/// what went into each platform's layer (for the release and its SBOM).
pub struct Built {
    /// `localhost/capture:<version>`.
    pub name: String,
    /// What `capture version` says (`<package version>` on a tagged release commit, else
    /// `<package version>-dev.<commit>`), and so the tag.
    pub version: String,
    /// The image index's digest, `sha256:…`: what the name points at.
    pub digest: String,
    pub archive: PathBuf,
    /// One per platform, in the index's order.
    pub platforms: Vec<BuiltPlatform>,
}

/// One platform's image.
pub struct BuiltPlatform {
    pub arch: Arch,
    /// Its manifest's digest.
    pub digest: String,
    /// The static `capture` and `capture-cni` its layer holds.
    pub binaries: Vec<PathBuf>,
    /// Every other file of its layer, and the Debian package it comes from.
    pub files: Vec<LayerFile>,
}

/// A file of a layer taken from Debian's packages.
pub struct LayerFile {
    pub in_image: String,
    /// Where it was read from on this machine.
    pub source: PathBuf,
    pub package: DebPackage,
}

impl Built {
    /// This machine's platform: the one the tests run.
    pub fn host(&self) -> &BuiltPlatform {
        self.platforms
            .iter()
            .find(|p| p.arch.is_host())
            .unwrap_or(&self.platforms[0])
    }
}

/// Builds the image and prints its name, digest and size.
pub fn build(opts: &Options) -> Result<Built> {
    build_image(opts, KernelPrograms::Shared, &Commit::head()?)
}

fn build_image(opts: &Options, kernel: KernelPrograms, commit: &Commit) -> Result<Built> {
    let out = opts.out.clone().unwrap_or_else(archive_path);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let mut platforms = Vec::new();
    let mut layers = Vec::new();
    for arch in arch::ALL {
        let (layer, platform) = build_platform(arch, kernel)?;
        layers.push(layer);
        platforms.push(platform);
    }
    // The tag is what the binary says it is: one rule (capture/build.rs) for both.
    let host_binary = platforms
        .iter()
        .find(|p| p.arch.is_host())
        .context("no platform of the image is this machine's")?
        .binaries[0]
        .clone();
    let version = binary_version(&host_binary)?;
    let name = format!("{REPOSITORY}:{version}");
    let images: Vec<PlatformImage<'_>> = platforms
        .iter()
        .zip(&layers)
        .map(|(platform, layer)| PlatformImage {
            architecture: platform.arch.oci,
            variant: platform.arch.variant,
            layer,
            config: image_config(&version, commit, &platform.files),
        })
        .collect();
    let written = capture_oci::write_index_archive(
        &out,
        &name,
        Compression::Gzip,
        commit.unix_time,
        Some(&commit.iso_time),
        &images,
    )
    .with_context(|| format!("writing {}", out.display()))?;
    println!("image: {name}");
    println!("digest: {} (index)", written.index);
    for (platform, (said, digest, bytes)) in platforms.iter_mut().zip(&written.manifests) {
        platform.digest.clone_from(digest);
        println!(
            "  {said}: {digest}, layer {:.1} MiB compressed",
            *bytes as f64 / f64::from(1 << 20)
        );
    }
    println!(
        "archive: {} ({:.1} MiB)",
        out.display(),
        written.archive_bytes as f64 / f64::from(1 << 20)
    );
    println!(
        "load it on a node: ctr -n k8s.io images import {}",
        out.display()
    );
    Ok(Built {
        name,
        version,
        digest: written.index,
        archive: out,
        platforms,
    })
}

/// One platform's binaries and layer, and what the layer took from where.
fn build_platform(
    arch: Arch,
    kernel: KernelPrograms,
) -> Result<(capture_oci::Layer, BuiltPlatform)> {
    let binaries = static_binaries(arch, kernel)?;
    let source = Source::of(arch)?;
    let (layer, taken) = layer::layer(arch, &source, &binaries)?;
    let sources: Vec<PathBuf> = taken.iter().map(|t| t.source.clone()).collect();
    let owners = source.owners(&sources)?;
    let files = taken
        .into_iter()
        .map(|t| {
            let package = owners
                .get(&t.source)
                .cloned()
                .with_context(|| format!("no Debian package known for {}", t.source.display()))?;
            Ok(LayerFile {
                package,
                in_image: t.in_image,
                source: t.source,
            })
        })
        .collect::<Result<_>>()?;
    let platform = BuiltPlatform {
        arch,
        // Known once the archive is written.
        digest: String::new(),
        binaries,
        files,
    };
    Ok((layer, platform))
}

/// The image config's `config` object of one platform.
fn image_config(version: &str, commit: &Commit, files: &[LayerFile]) -> serde_json::Value {
    let mut packages: Vec<String> = files
        .iter()
        .map(|f| format!("{}={}", f.package.name, f.package.version))
        .collect();
    packages.sort();
    packages.dedup();
    json!({
        "Entrypoint": ["/usr/local/bin/capture"],
        "Cmd": ["agent"],
        "Env": ["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"],
        "WorkingDir": "/",
        "Labels": {
            "org.opencontainers.image.title": "capture",
            "org.opencontainers.image.description": "eBPF traffic capture for mesh sidecars: the node agent and the chained CNI plugin",
            "org.opencontainers.image.version": version,
            "org.opencontainers.image.revision": commit.revision,
            "org.opencontainers.image.created": commit.iso_time,
            "org.opencontainers.image.licenses": "Apache-2.0",
            "dev.capture.debian-packages": packages.join(" "),
        },
    })
}

/// The version a `capture` binary says it is (`capture version --json`).
fn binary_version(capture: &std::path::Path) -> Result<String> {
    let json = output(Command::new(capture).args(["version", "--json"]))?;
    let info: serde_json::Value =
        serde_json::from_str(&json).with_context(|| format!("capture version --json: {json}"))?;
    info["version"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no version in {json}"))
}

/// Where the archive goes by default (and where the tests look for it): one name whatever the
/// version, which is inside (a release names its copy by version).
pub fn archive_path() -> PathBuf {
    crate::builds::target_dir().join("image/capture.oci.tar")
}

/// The static builds' own target directory: their flags differ from every other build's.
fn static_target_dir() -> PathBuf {
    crate::builds::target_dir().join("image-build")
}

/// `capture` and `capture-cni` for `arch`, release builds linked statically and carrying their
/// dependency list (cargo-auditable), in their own target directory (the flags differ from
/// every other build's). Another architecture's link with Debian's cross compiler, which setup
/// installs with the Rust target.
fn static_binaries(arch: Arch, kernel: KernelPrograms) -> Result<Vec<PathBuf>> {
    let dir = static_target_dir();
    let mut cmd = cargo();
    if kernel == KernelPrograms::Afresh {
        cmd.env_remove("CAPTURE_EBPF_TARGET_DIR");
    }
    let prefix = arch.cargo_env_prefix();
    cmd.env(
        format!("{prefix}_RUSTFLAGS"),
        "-C target-feature=+crt-static",
    );
    arch.link_with_cross_compiler(&mut cmd);
    run(cmd
        .env("CARGO_TARGET_DIR", &dir)
        // cargo-auditable records every crate compiled in, in the binary's `.dep-v0` section,
        // where scanners (syft, trivy, grype) read it.
        .args([
            "auditable",
            "build",
            "--release",
            "--locked",
            "-p",
            "capture",
            "-p",
            "capture-cni",
        ])
        .args([
            "--bin",
            "capture",
            "--bin",
            "capture-cni",
            "--target",
            arch.rust_target,
        ]))
    .with_context(|| {
        format!(
            "building the {} binaries: run cargo xtask setup (it adds the Rust target {} and \
             Debian's cross compiler)",
            arch.oci, arch.rust_target
        )
    })?;
    let binaries: Vec<PathBuf> = ["capture", "capture-cni"]
        .iter()
        .map(|b| dir.join(arch.rust_target).join("release").join(b))
        .collect();
    for bin in &binaries {
        let linking = elf::linking(&std::fs::read(bin)?)?;
        if linking.machine != arch.elf_machine {
            bail!("{} is not an {} binary", bin.display(), arch.oci);
        }
        if linking.interpreter.is_some() || !linking.needed.is_empty() {
            bail!("{} is not statically linked: {linking:?}", bin.display());
        }
    }
    Ok(binaries)
}

/// The Debian package (`name:arch` where dpkg says so) that holds each host file of `paths`,
/// asked of dpkg once for them all (once per file took seconds).
pub fn owning_packages<'a>(
    paths: impl Iterator<Item = &'a str> + Clone,
) -> Result<BTreeMap<String, String>> {
    // dpkg knows a file by the path its package ships it at, which on a merged-/usr system may be
    // the other side of the /usr link.
    let alias = |path: &str| {
        path.strip_prefix("/usr")
            .map_or_else(|| format!("/usr{path}"), str::to_string)
    };
    let asked: Vec<String> = paths
        .clone()
        .flat_map(|p| [p.to_string(), alias(p)])
        .collect();
    // Exits 1 when any path (an alias, always) is unknown; what it found is still printed.
    let out = Command::new("dpkg-query")
        .arg("-S")
        .args(&asked)
        .output()
        .context("running dpkg-query -S")?;
    let mut owner = BTreeMap::new();
    // `libc6:amd64: /lib/x86_64-linux-gnu/libc.so.6`; `diversion by …` lines name no owner.
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        if let Some((packages, path)) = line.split_once(": ") {
            if !line.starts_with("diversion by ") {
                let first = packages.split(", ").next().unwrap_or(packages);
                owner.insert(path.to_string(), first.to_string());
            }
        }
    }
    paths
        .map(|path| {
            let package = owner
                .get(path)
                .or_else(|| owner.get(&alias(path)))
                .with_context(|| format!("which Debian package holds {path}: dpkg knows none"))?;
            Ok((path.to_string(), package.clone()))
        })
        .collect()
}

/// The commit an image is built from: its time stamps every entry.
struct Commit {
    revision: String,
    unix_time: u64,
    iso_time: String,
}

impl Commit {
    fn head() -> Result<Self> {
        let log = output(Command::new("git").args(["log", "-1", "--format=%H %ct %cI"]))?;
        let mut words = log.split_whitespace();
        let (Some(hash), Some(time), Some(iso)) = (words.next(), words.next(), words.next()) else {
            bail!("git log gave {log:?}");
        };
        let dirty = !output(Command::new("git").args(["status", "--porcelain"]))?.is_empty();
        Ok(Self {
            revision: if dirty {
                format!("{hash}-dirty")
            } else {
                hash.to_string()
            },
            unix_time: time.parse().context("commit time")?,
            iso_time: iso.to_string(),
        })
    }
}
