//! `cargo xtask image`: the node agent's container image, as an OCI archive that containerd
//! imports (`ctr -n k8s.io images import`) and skopeo copies to a registry.
//!
//! Written directly (capture-oci) rather than by buildah, umoci or a Docker daemon: the image is
//! one layer of known files, so a writer of sorted, root-owned tar entries stamped with the
//! commit's time is all it takes, every byte follows from the inputs (two builds of one commit
//! give one digest), and nothing beyond what setup already installs is needed. The layer holds
//! - `capture` and `capture-cni`, linked statically (glibc's `crt-static`), so the capture-cni
//!   that `install-cni` copies into the host's /opt/cni/bin runs whatever the host's libc;
//! - what the agent runs in its container, from this machine's Debian packages (setup installs
//!   them; their versions are in the image's labels): iptables and ip6tables in both the nft and
//!   the legacy variant (`xtables-nft-multi`, `xtables-legacy-multi`, the names Debian links to
//!   them, and their match and target extensions), `nft` (nftables, for the nftables backend),
//!   `ip` (iproute2) and `nsenter` (util-linux),
//!   with the shared libraries the dynamic loader gives each;
//! - `/tmp`, `/run` and the merged-/usr links. Nothing else: no shell, no package manager.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use capture_oci::{Compression, Image, Layer};
use serde_json::json;

use crate::{cargo, output, run};

/// The repository the image is named under: `localhost/` says it is loaded onto nodes (or
/// pushed under another name), never pulled from a public registry by a short name.
pub const REPOSITORY: &str = "localhost/capture";

/// The Rust target the static binaries build for.
const STATIC_TARGET: &str = "x86_64-unknown-linux-gnu";

/// Where Debian's iptables keeps its match and target extensions (loaded with dlopen, so no
/// binary names them as libraries).
const XTABLES_DIR: &str = "/usr/lib/x86_64-linux-gnu/xtables";

/// The programs the agent runs in its container (the iptables names below link to the first two).
const ELF_TOOLS: [&str; 5] = [
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/nft",
    "/usr/bin/ip",
    "/usr/bin/nsenter",
];

/// The iptables names the agent runs or an operator may (Debian links each to its multi-call
/// binary); the unsuffixed ones point at the nft variant, as Debian's alternatives do by default.
const IPTABLES_NAMES: [&str; 6] = [
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
];

pub struct Options {
    pub out: Option<PathBuf>,
}

/// Builds the image twice, compiling `capture` and `capture-cni` afresh for the second, and fails
/// unless both archives carry the same digest.
pub fn check_reproducible() -> Result<()> {
    let first_path = archive_path().with_extension("first.tar");
    let first = build(&Options {
        out: Some(first_path.clone()),
    })?
    .digest;
    run(cargo().env("CARGO_TARGET_DIR", static_target_dir()).args([
        "clean",
        "--release",
        "-p",
        "capture-sys",
        "-p",
        "capture-model",
        "-p",
        "capture-user",
        "-p",
        "capture",
        "-p",
        "capture-cni",
        "--target",
        STATIC_TARGET,
    ]))?;
    // The kernel programs too: the first build may have taken them from the shared directory.
    let second = build_image(&Options { out: None }, KernelPrograms::Afresh)?.digest;
    std::fs::remove_file(&first_path)?;
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
/// what went into its layer (for the release's SBOM).
pub struct Built {
    /// `localhost/capture:<version>`.
    pub name: String,
    /// What `capture version` says (`<package version>` on a tagged release commit, else
    /// `<package version>-dev.<commit>`), and so the tag.
    pub version: String,
    /// The image manifest's digest, `sha256:…`.
    pub digest: String,
    pub archive: PathBuf,
    /// The static `capture` and `capture-cni` the layer holds.
    pub binaries: Vec<PathBuf>,
    /// Every other file of the layer, as `(path in the image, path on this machine)`.
    pub host_files: Vec<(String, String)>,
    /// The Debian package (`name:arch`) of each host file, by its path on this machine.
    pub owners: BTreeMap<String, String>,
}

/// Builds the image and prints its name, digest and size.
pub fn build(opts: &Options) -> Result<Built> {
    build_image(opts, KernelPrograms::Shared)
}

fn build_image(opts: &Options, kernel: KernelPrograms) -> Result<Built> {
    let out = opts.out.clone().unwrap_or_else(archive_path);
    if let Some(dir) = out.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let binaries = static_binaries(kernel)?;
    // The tag is what the binary says it is: one rule (capture/build.rs) for both.
    let version = binary_version(&binaries[0])?;
    let name = format!("{REPOSITORY}:{version}");
    let commit = Commit::head()?;

    let (layer, host_files) = layer(&binaries)?;
    let owners = owning_packages(host_files.iter().map(|(_, host)| host.as_str()))?;
    let packages = package_versions(&owners)?;
    let image = Image {
        name: name.clone(),
        config: json!({
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
        }),
    };
    let written = capture_oci::write_archive(
        &out,
        &layer,
        Compression::Gzip,
        commit.unix_time,
        Some(&commit.iso_time),
        &[image],
    )
    .with_context(|| format!("writing {}", out.display()))?;
    let (_, digest) = &written.manifests[0];
    println!("image: {name}");
    println!("digest: {digest}");
    println!(
        "size: {:.1} MiB compressed ({:.1} MiB archive)",
        written.layer_bytes as f64 / f64::from(1 << 20),
        written.archive_bytes as f64 / f64::from(1 << 20)
    );
    println!("archive: {}", out.display());
    println!(
        "load it on a node: ctr -n k8s.io images import {}",
        out.display()
    );
    Ok(Built {
        name,
        version,
        digest: digest.clone(),
        archive: out,
        binaries,
        host_files,
        owners,
    })
}

/// The version a `capture` binary says it is (`capture version --json`).
fn binary_version(capture: &Path) -> Result<String> {
    let json = output(Command::new(capture).args(["version", "--json"]))?;
    let info: serde_json::Value =
        serde_json::from_str(&json).with_context(|| format!("capture version --json: {json}"))?;
    info["version"]
        .as_str()
        .map(str::to_string)
        .with_context(|| format!("no version in {json}"))
}

/// The image's layer: the static binaries, the tools and what they load, the directories and
/// links a container expects; and the host files it took, as `(path in the image, path here)`.
fn layer(binaries: &[PathBuf]) -> Result<(Layer, Vec<(String, String)>)> {
    let mut layer = Layer::new();
    for (link, target) in [
        ("/bin", "usr/bin"),
        ("/sbin", "usr/sbin"),
        ("/lib", "usr/lib"),
        ("/lib64", "usr/lib64"),
    ] {
        layer.symlink(link, target);
    }
    layer.dir("/tmp", 0o1777);
    // iptables-legacy takes its lock in /run; the agent's socket and records live in /run/capture
    // (a host mount in the manifest).
    layer.dir("/run", 0o755);
    layer.dir("/etc", 0o755);
    for bin in binaries {
        let name = bin.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        layer.file(
            &format!("/usr/local/bin/{name}"),
            std::fs::read(bin)?,
            0o755,
        );
    }
    let mut taken = Vec::new();
    for path in ELF_TOOLS {
        copy_host_file(&mut layer, path, path)?;
        taken.push((path.to_string(), path.to_string()));
    }
    for name in IPTABLES_NAMES {
        for variant in ["nft", "legacy"] {
            layer.symlink(
                &format!("/usr/sbin/{}", of_variant(name, variant)),
                &format!("xtables-{variant}-multi"),
            );
        }
        layer.symlink(&format!("/usr/sbin/{name}"), &of_variant(name, "nft"));
    }
    for entry in std::fs::read_dir(XTABLES_DIR)
        .with_context(|| format!("reading {XTABLES_DIR}: install iptables"))?
    {
        let path = entry?.path();
        let file = path
            .file_name()
            .and_then(|n| n.to_str())
            .unwrap_or_default();
        // The iptables and ip6tables extensions; ebtables' and arptables' are not run here.
        if ["libxt_", "libipt_", "libip6t_"]
            .iter()
            .any(|p| file.starts_with(p))
        {
            let image_path = format!("{XTABLES_DIR}/{file}");
            copy_host_file(&mut layer, &image_path, &path.to_string_lossy())?;
            taken.push((image_path, path.to_string_lossy().into_owned()));
        }
    }
    let mut libraries = BTreeSet::new();
    for (_, elf) in &taken {
        libraries.extend(capture_oci::shared_libraries(Path::new(elf))?);
    }
    for lib in libraries {
        let in_image = image_path(&lib)?;
        copy_host_file(&mut layer, &in_image, &lib)?;
        taken.push((in_image, lib));
    }
    // One entry per file of the image: two names the loader gives may be one file there.
    taken.sort();
    taken.dedup_by(|a, b| a.0 == b.0);
    Ok((layer, taken))
}

/// Debian's name of an iptables program in one variant: `iptables-save` in `legacy` is
/// `iptables-legacy-save`.
fn of_variant(name: &str, variant: &str) -> String {
    match name.split_once('-') {
        Some((base, op)) => format!("{base}-{variant}-{op}"),
        None => format!("{name}-{variant}"),
    }
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

/// `capture` and `capture-cni`, release builds linked statically and carrying their dependency
/// list (cargo-auditable), in their own target directory (the flags differ from every other
/// build's).
fn static_binaries(kernel: KernelPrograms) -> Result<Vec<PathBuf>> {
    let dir = static_target_dir();
    let mut cmd = cargo();
    if kernel == KernelPrograms::Afresh {
        cmd.env_remove("CAPTURE_EBPF_TARGET_DIR");
    }
    run(cmd
        .env(
            format!(
                "CARGO_TARGET_{}_RUSTFLAGS",
                STATIC_TARGET.to_uppercase().replace('-', "_")
            ),
            "-C target-feature=+crt-static",
        )
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
            STATIC_TARGET,
        ]))?;
    let binaries: Vec<PathBuf> = ["capture", "capture-cni"]
        .iter()
        .map(|b| dir.join(STATIC_TARGET).join("release").join(b))
        .collect();
    for bin in &binaries {
        if !capture_oci::shared_libraries(bin)?.is_empty() {
            bail!("{} is not statically linked", bin.display());
        }
    }
    Ok(binaries)
}

/// Copies a host file (its content, through symlinks, and its permissions) into the layer at
/// `image_path`.
fn copy_host_file(layer: &mut Layer, image_path: &str, host_path: &str) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let context = || format!("reading {host_path} for the image: run cargo xtask setup");
    let data = std::fs::read(host_path).with_context(context)?;
    let mode = std::fs::metadata(host_path)
        .with_context(context)?
        .permissions()
        .mode()
        & 0o7777;
    layer.file(image_path, data, mode);
    Ok(())
}

/// Where a library the host's loader names goes in the image: its directory as the host resolves
/// it (`/lib/x86_64-linux-gnu` is `/usr/lib/x86_64-linux-gnu` on a merged-/usr system, and so in
/// the image, whose `/lib` is a link), under the name the loader asked for.
fn image_path(host_path: &str) -> Result<String> {
    let path = Path::new(host_path);
    let (Some(dir), Some(file)) = (path.parent(), path.file_name()) else {
        bail!("{host_path} is not a file path");
    };
    let dir = std::fs::canonicalize(dir).with_context(|| format!("resolving {}", dir.display()))?;
    Ok(dir.join(file).to_string_lossy().into_owned())
}

/// `package=version` of the Debian packages `owners` names, sorted.
fn package_versions(owners: &BTreeMap<String, String>) -> Result<Vec<String>> {
    let packages: BTreeSet<&String> = owners.values().collect();
    let mut versions = Vec::new();
    for package in packages {
        versions.push(output(Command::new("dpkg-query").args([
            "-W",
            "-f=${Package}=${Version}",
            package,
        ]))?);
    }
    Ok(versions)
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
