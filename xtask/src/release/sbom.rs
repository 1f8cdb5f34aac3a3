//! The release's SBOM: CycloneDX 1.5 JSON, built and validated with the CycloneDX project's own
//! library (cyclonedx-bom), from what the build really holds:
//! - each static binary, and every crate compiled into it as the binary itself lists them
//!   (cargo-auditable's `.dep-v0` section), with the licence `cargo metadata` gives and the
//!   checksum Cargo.lock pins;
//! - the kernel objects the binaries embed, and the crates compiled into them;
//! - every other file of the image, under the Debian package it was copied from, with that
//!   package's version and the licences its copyright file names.
//!
//! The subject is the image index; each platform's image is a component of its own, nesting its
//! binaries and its Debian packages (whose files nest in turn), so that one name (`capture`,
//! `/usr/sbin/nft`) may appear once per platform.

use std::{
    collections::{BTreeMap, BTreeSet},
    process::Command,
    str::FromStr as _,
};

use anyhow::{bail, Context as _, Result};
use cyclonedx_bom::{
    models::{
        component::Classification,
        dependency::{Dependencies, Dependency},
        hash::{Hash, HashAlgorithm, HashValue, Hashes},
        license::{LicenseChoice, Licenses},
        property::{Properties, Property},
        tool::{Tool, Tools},
    },
    prelude::*,
};
use serde_json::Value;

use crate::{
    image::{Built, BuiltPlatform, LayerFile},
    output,
};

/// The kernel objects capture-user's build embeds (capture-ebpf's binaries), by name.
const KERNEL_OBJECTS: [&str; 3] = ["capture", "netns-cookie", "adopt-listeners"];

/// The SBOM of `built`, as JSON.
pub fn generate(built: &Built) -> Result<Vec<u8>> {
    let crates = CrateFacts::read()?;
    // Top-level components by bom-ref: the platforms' images (nesting what each holds), the
    // kernel objects and every crate compiled into a binary or an object.
    let mut components = BTreeMap::new();
    let mut dependencies = Vec::new();
    let mut add_built = |component: Component, uses: Vec<Component>, nest: Option<&mut Vec<_>>| {
        dependencies.push(depends(&component, &uses));
        for c in uses {
            components.entry(bom_ref(&c)).or_insert(c);
        }
        match nest {
            Some(nested) => nested.push(component),
            None => {
                components.insert(bom_ref(&component), component);
            }
        }
    };
    // One set of kernel objects: built once, embedded in every platform's capture.
    let mut object_refs = Vec::new();
    for (object, uses) in kernel_objects(&crates, &built.host().binaries[0])? {
        object_refs.push(bom_ref(&object));
        add_built(object, uses, None);
    }
    let mut images = Vec::new();
    for platform in &built.platforms {
        let mut nested = Vec::new();
        for binary in &platform.binaries {
            let (component, uses) = binary_component(binary, &built.version, platform, &crates)?;
            add_built(component, uses, Some(&mut nested));
        }
        nested.extend(debian_packages(platform)?);
        let mut image = platform_component(built, platform);
        let mut holds: Vec<String> = nested.iter().map(bom_ref).collect();
        holds.extend(object_refs.iter().cloned());
        image.components = Some(Components(nested));
        images.push((image, holds));
    }
    let mut top = Vec::new();
    for (image, holds) in images {
        top.push(bom_ref(&image));
        dependencies.push(Dependency {
            dependency_ref: bom_ref(&image),
            dependencies: holds,
        });
        components.insert(bom_ref(&image), image);
    }
    let image = image_component(built);
    dependencies.push(Dependency {
        dependency_ref: image.bom_ref.clone().unwrap_or_default(),
        dependencies: top,
    });
    let bom = Bom {
        serial_number: Some(serial_number(&built.digest)?),
        metadata: Some(Metadata {
            timestamp: Some(commit_time()?),
            tools: Some(Tools::List(vec![Tool {
                vendor: None,
                name: Some(NormalizedString::new("cargo xtask release (cyclonedx-bom)")),
                version: Some(NormalizedString::new(env!("CARGO_PKG_VERSION"))),
                hashes: None,
                external_references: None,
            }])),
            component: Some(image),
            ..Metadata::default()
        }),
        components: Some(Components(components.into_values().collect())),
        dependencies: Some(Dependencies(dependencies)),
        spec_version: SpecVersion::V1_5,
        ..Bom::default()
    };
    let checked = bom.validate_version(SpecVersion::V1_5);
    if !checked.passed() {
        bail!("the SBOM does not validate as CycloneDX 1.5: {checked:?}");
    }
    let mut json = Vec::new();
    bom.output_as_json_v1_5(&mut json)
        .context("writing the SBOM")?;
    Ok(json)
}

fn bom_ref(component: &Component) -> String {
    component.bom_ref.clone().unwrap_or_default()
}

fn depends(component: &Component, uses: &[Component]) -> Dependency {
    Dependency {
        dependency_ref: component.bom_ref.clone().unwrap_or_default(),
        dependencies: uses.iter().filter_map(|c| c.bom_ref.clone()).collect(),
    }
}

/// One platform's image, by its manifest's digest.
fn platform_component(built: &Built, platform: &BuiltPlatform) -> Component {
    let mut image = oci_component(built, &platform.digest, Some(platform.arch.oci));
    image.properties = Some(Properties(vec![Property::new(
        "capture:platform",
        &platform.arch.platform(),
    )]));
    image
}

/// The image index: the SBOM's subject, the name's target.
fn image_component(built: &Built) -> Component {
    let mut image = oci_component(built, &built.digest, None);
    image.licenses = Some(Licenses(vec![LicenseChoice::expression("Apache-2.0")]));
    image
}

/// The image (an index, or one platform's manifest where `arch` is given) by `digest`: its
/// purl names the repository, the tag and the architecture.
fn oci_component(built: &Built, digest: &str, arch: Option<&str>) -> Component {
    let mut image = Component::new(
        Classification::Container,
        "capture",
        &built.version,
        Some(format!("image:{digest}")),
    );
    let repository = crate::image::REPOSITORY;
    let arch = arch.map_or_else(String::new, |a| format!("arch={a}&"));
    image.purl = Purl::from_str(&format!(
        "pkg:oci/capture@{}?{arch}repository_url={repository}&tag={}",
        digest.replace(':', "%3A"),
        built.version
    ))
    .ok();
    image.hashes = Some(Hashes(vec![sha256_hash(
        digest.trim_start_matches("sha256:"),
    )]));
    image
}

/// What `cargo metadata` and Cargo.lock say of every crate of the workspace's graph.
struct CrateFacts {
    /// `name@version` → the package's metadata.
    packages: BTreeMap<String, Value>,
    /// `name@version` → its registry checksum.
    checksums: BTreeMap<String, String>,
    /// The resolved graph: package id → the ids of its normal dependencies.
    resolve: BTreeMap<String, Vec<String>>,
}

impl CrateFacts {
    fn read() -> Result<Self> {
        let metadata: Value = serde_json::from_str(&output(crate::cargo().args([
            "metadata",
            "--format-version",
            "1",
            "--locked",
        ]))?)?;
        let packages = metadata["packages"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|p| (key(p), p.clone()))
            .collect();
        let resolve = metadata["resolve"]["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|node| {
                let normal = node["deps"]
                    .as_array()
                    .into_iter()
                    .flatten()
                    .filter(|d| {
                        d["dep_kinds"]
                            .as_array()
                            .into_iter()
                            .flatten()
                            .any(|k| k["kind"].is_null())
                    })
                    .filter_map(|d| d["pkg"].as_str().map(str::to_string))
                    .collect();
                (node["id"].as_str().unwrap_or_default().to_string(), normal)
            })
            .collect();
        let lock = std::fs::read_to_string("Cargo.lock").context("reading Cargo.lock")?;
        Ok(Self {
            packages,
            checksums: lock_checksums(&lock),
            resolve,
        })
    }

    /// The crate `name@version` as a component.
    fn component(&self, name: &str, version: &str, build_only: bool) -> Result<Component> {
        let id = format!("{name}@{version}");
        let meta = self
            .packages
            .get(&id)
            .with_context(|| format!("{id} is in a binary but not in cargo metadata"))?;
        let mut c = Component::new(
            Classification::Library,
            name,
            version,
            Some(format!("crate:{id}")),
        );
        c.purl = Purl::new("cargo", name, version).ok();
        if let Some(license) = meta["license"].as_str() {
            // Old crates write `MIT/Apache-2.0`, which SPDX spells with OR.
            let spdx: Vec<&str> = license.split('/').map(str::trim).collect();
            c.licenses = Some(Licenses(vec![LicenseChoice::expression(
                &spdx.join(" OR "),
            )]));
        }
        if let Some(sum) = self.checksums.get(&id) {
            c.hashes = Some(Hashes(vec![sha256_hash(sum)]));
        }
        let source = meta["source"].as_str().unwrap_or("local (this workspace)");
        let mut properties = vec![Property::new("capture:source", source)];
        if build_only {
            // Compiled for the build (a build script's dependency), not into the binary.
            c.scope = Some(cyclonedx_bom::models::component::Scope::Excluded);
            properties.push(Property::new("capture:kind", "build"));
        }
        c.properties = Some(Properties(properties));
        Ok(c)
    }

    /// The crates `root` (`name@version`) is compiled from: itself and its normal dependencies,
    /// transitively.
    fn closure(&self, root: &str) -> Result<Vec<(String, String)>> {
        let id_of = |k: &str| self.packages.get(k).and_then(|p| p["id"].as_str());
        let start = id_of(root).with_context(|| format!("{root} is not in cargo metadata"))?;
        let by_id: BTreeMap<&str, &Value> = self
            .packages
            .values()
            .filter_map(|p| Some((p["id"].as_str()?, p)))
            .collect();
        let (mut seen, mut todo) = (BTreeSet::new(), vec![start.to_string()]);
        while let Some(id) = todo.pop() {
            if seen.insert(id.clone()) {
                todo.extend(self.resolve.get(&id).cloned().unwrap_or_default());
            }
        }
        Ok(seen
            .iter()
            .filter_map(|id| by_id.get(id.as_str()))
            .map(|p| {
                let name = p["name"].as_str().unwrap_or_default().to_string();
                (name, p["version"].as_str().unwrap_or_default().to_string())
            })
            .collect())
    }
}

fn key(package: &Value) -> String {
    format!(
        "{}@{}",
        package["name"].as_str().unwrap_or_default(),
        package["version"].as_str().unwrap_or_default()
    )
}

/// `name@version` → `checksum` of every `[[package]]` of a Cargo.lock that has one.
fn lock_checksums(lock: &str) -> BTreeMap<String, String> {
    let mut sums = BTreeMap::new();
    for package in lock.split("[[package]]").skip(1) {
        let field = |name: &str| {
            package.lines().find_map(|l| {
                l.strip_prefix(name)?
                    .trim_start()
                    .strip_prefix('=')
                    .map(|v| v.trim().trim_matches('"').to_string())
            })
        };
        if let (Some(name), Some(version), Some(sum)) =
            (field("name"), field("version"), field("checksum"))
        {
            sums.insert(format!("{name}@{version}"), sum);
        }
    }
    sums
}

/// A static binary and the crates it lists in its `.dep-v0` section.
fn binary_component(
    binary: &std::path::Path,
    version: &str,
    platform: &BuiltPlatform,
    crates: &CrateFacts,
) -> Result<(Component, Vec<Component>)> {
    let json = auditable_info::json_from_file(binary, auditable_info::Limits::default())
        .with_context(|| {
            format!(
                "reading the dependency list of {} (built by cargo auditable: run cargo xtask setup)",
                binary.display()
            )
        })?;
    let info: Value = serde_json::from_str(&json)?;
    let mut uses = Vec::new();
    for package in info["packages"].as_array().into_iter().flatten() {
        let (name, crate_version) = (
            package["name"].as_str().unwrap_or_default(),
            package["version"].as_str().unwrap_or_default(),
        );
        let build_only = package["kind"] == "build";
        uses.push(crates.component(name, crate_version, build_only)?);
    }
    let name = binary
        .file_name()
        .and_then(|n| n.to_str())
        .unwrap_or_default();
    let mut c = Component::new(
        Classification::Application,
        name,
        version,
        Some(format!("binary:{}:{name}", platform.arch.platform())),
    );
    c.hashes = Some(Hashes(vec![file_hash(binary)?]));
    c.licenses = Some(Licenses(vec![LicenseChoice::expression("Apache-2.0")]));
    c.properties = Some(Properties(vec![
        Property::new("capture:image-path", &format!("/usr/local/bin/{name}")),
        Property::new("capture:platform", &platform.arch.platform()),
    ]));
    Ok((c, uses))
}

/// The kernel objects `capture` embeds, each with the crates it is compiled from; the first's
/// build id checked against what the binary says it carries.
fn kernel_objects(
    crates: &CrateFacts,
    capture: &std::path::Path,
) -> Result<Vec<(Component, Vec<Component>)>> {
    let dir = crate::builds::ebpf_target_dir()?.join("bpfel-unknown-none/release");
    let ebpf = crates
        .packages
        .values()
        .find(|p| p["name"] == "capture-ebpf")
        .context("capture-ebpf is not in cargo metadata")?;
    let ebpf_id = key(ebpf);
    let licence = ebpf["license"].as_str().unwrap_or("MIT OR GPL-2.0-only");
    let mut uses = Vec::new();
    for (name, version) in crates.closure(&ebpf_id)? {
        uses.push(crates.component(&name, &version, false)?);
    }
    let said: Value =
        serde_json::from_str(&output(Command::new(capture).args(["version", "--json"]))?)?;
    let mut objects = Vec::new();
    for object in KERNEL_OBJECTS {
        let path = dir.join(object);
        let data = std::fs::read(&path).with_context(|| format!("reading {}", path.display()))?;
        if object == "capture" && said["programs"] != format!("{:016x}", fnv1a(&data)) {
            bail!(
                "{} is not the object {} embeds (programs {}): rebuild",
                path.display(),
                capture.display(),
                said["programs"]
            );
        }
        let mut c = Component::new(
            Classification::File,
            &format!("{object}.bpf.o"),
            ebpf["version"].as_str().unwrap_or_default(),
            Some(format!("kernel-object:{object}")),
        );
        c.description = Some(NormalizedString::new(
            "eBPF object (bpfel), embedded in capture and loaded into the node's kernel",
        ));
        c.hashes = Some(Hashes(vec![sha256_hash(&capture_oci::sha256(&data))]));
        c.licenses = Some(Licenses(vec![LicenseChoice::expression(licence)]));
        objects.push((c, uses.clone()));
    }
    Ok(objects)
}

/// FNV-1a, as capture-user's build.rs names the kernel object (`capture version`'s `programs`).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// The Debian packages a platform's other files come from, each file a component of its package.
fn debian_packages(platform: &BuiltPlatform) -> Result<Vec<Component>> {
    let mut by_package: BTreeMap<&str, Vec<&LayerFile>> = BTreeMap::new();
    for file in &platform.files {
        by_package.entry(&file.package.name).or_default().push(file);
    }
    let release = os_release_id()?;
    let mut packages = Vec::new();
    for files in by_package.into_values() {
        let package = &files[0].package;
        let (name, version, arch) = (&package.name, &package.version, &package.architecture);
        let mut c = Component::new(
            Classification::Library,
            name,
            version,
            Some(format!("deb:{name}:{arch}@{version}")),
        );
        c.purl = Purl::from_str(&format!(
            "pkg:deb/debian/{name}@{}?arch={arch}&distro={release}",
            version.replace('+', "%2B").replace(':', "%3A")
        ))
        .ok();
        c.licenses = Some(Licenses(
            debian_licences(&package.copyright)
                .iter()
                .map(|l| LicenseChoice::license(l))
                .collect(),
        ));
        c.properties = Some(Properties(vec![Property::new(
            "capture:debian-source",
            &package.source,
        )]));
        let mut nested = Vec::new();
        for file in files {
            let mut f = Component::new(
                Classification::File,
                &file.in_image,
                version,
                Some(format!(
                    "file:{}:{}",
                    platform.arch.platform(),
                    file.in_image
                )),
            );
            f.hashes = Some(Hashes(vec![file_hash(&file.source)?]));
            nested.push(f);
        }
        c.components = Some(Components(nested));
        packages.push(c);
    }
    Ok(packages)
}

/// The licences a Debian package's machine-readable copyright file names (`License:` fields),
/// or the file's path where it is not machine-readable.
fn debian_licences(copyright: &std::path::Path) -> Vec<String> {
    let text = std::fs::read_to_string(copyright).unwrap_or_default();
    let names: BTreeSet<String> = text
        .lines()
        .filter_map(|l| l.strip_prefix("License:"))
        .map(|l| l.trim().to_string())
        .filter(|l| !l.is_empty())
        .collect();
    if names.is_empty() {
        let shown = copyright
            .to_string_lossy()
            .split_once("/usr/share/doc/")
            .map_or_else(
                || copyright.display().to_string(),
                |(_, p)| format!("/usr/share/doc/{p}"),
            );
        vec![format!("see {shown}")]
    } else {
        names.into_iter().collect()
    }
}

/// `debian-12`, from this machine's /etc/os-release.
fn os_release_id() -> Result<String> {
    let text = std::fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    let field = |name: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(name)?.strip_prefix('='))
            .map(|v| v.trim_matches('"').to_string())
    };
    Ok(format!(
        "{}-{}",
        field("ID").unwrap_or_else(|| "debian".into()),
        field("VERSION_ID").unwrap_or_default()
    ))
}

fn sha256_hash(hex: &str) -> Hash {
    Hash {
        alg: HashAlgorithm::SHA_256,
        content: HashValue(hex.to_string()),
    }
}

fn file_hash(path: &std::path::Path) -> Result<Hash> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    Ok(sha256_hash(&capture_oci::sha256(&data)))
}

/// One serial number per image: a UUID made of its digest's first bytes (two SBOMs of one image
/// are one document).
fn serial_number(digest: &str) -> Result<UrnUuid> {
    let hex = digest.trim_start_matches("sha256:");
    let h = |range: std::ops::Range<usize>| hex.get(range).unwrap_or("0");
    // Version 4's and the variant's bits set, as a UUID parser expects.
    let uuid = format!(
        "urn:uuid:{}-{}-4{}-8{}-{}",
        h(0..8),
        h(8..12),
        h(13..16),
        h(17..20),
        h(20..32)
    );
    UrnUuid::new(uuid).map_err(|e| anyhow::anyhow!("{e:?}"))
}

/// The commit's time, the SBOM's timestamp (not the clock's: one commit, one document).
fn commit_time() -> Result<DateTime> {
    let iso = output(Command::new("git").args(["log", "-1", "--format=%cI"]))?;
    DateTime::try_from(iso).map_err(|e| anyhow::anyhow!("{e:?}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checksums_come_from_registry_packages_only() {
        let lock = "version = 4\n\n[[package]]\nname = \"aya\"\nversion = \"0.14.0\"\n\
                    source = \"registry+https://example/index\"\nchecksum = \"abc\"\n\n\
                    [[package]]\nname = \"capture\"\nversion = \"0.2.0\"\n";
        let sums = lock_checksums(lock);
        assert_eq!(sums.get("aya@0.14.0").map(String::as_str), Some("abc"));
        assert_eq!(sums.len(), 1);
    }

    #[test]
    fn the_serial_number_is_a_uuid_of_the_digest() {
        let digest = format!("sha256:{}", "0123456789abcdef".repeat(4));
        let serial = serial_number(&digest).unwrap();
        assert_eq!(serial.0, "urn:uuid:01234567-89ab-4def-8123-456789abcdef");
    }
}
