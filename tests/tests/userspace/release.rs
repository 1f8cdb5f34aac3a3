//! The release `cargo xtask test` writes (`cargo xtask release`), checked as a platform team
//! admitting it would: its checksums, the manifest's image pinned to the archive's digest, and an
//! SBOM that names everything the image and the binaries hold, compared with what they hold.

use std::{
    collections::{BTreeMap, BTreeSet},
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::Value;

/// Every file under `dir`, by path relative to it.
fn files_under(dir: &Path) -> BTreeSet<String> {
    let mut files = BTreeSet::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for entry in std::fs::read_dir(&d).expect("a release directory") {
            let path = entry.expect("an entry").path();
            if path.is_dir() {
                todo.push(path);
            } else {
                let relative = path.strip_prefix(dir).expect("under the release");
                files.insert(relative.display().to_string());
            }
        }
    }
    files
}

/// One platform's image of the release.
struct PlatformImage {
    /// `linux/arm64/v8`, as the index says.
    platform: String,
    /// OCI's architecture: `amd64`, `arm64`.
    architecture: String,
    /// The files of its layer (path → content).
    files: BTreeMap<String, Vec<u8>>,
}

/// The release's image: its name, the digest the name points at (the index), and each
/// platform's image.
fn image(release: &Path) -> (String, String, Vec<PlatformImage>) {
    let archives: Vec<PathBuf> = std::fs::read_dir(release)
        .expect("the release")
        .map(|e| e.expect("an entry").path())
        .filter(|p| p.to_string_lossy().ends_with(".oci.tar"))
        .collect();
    assert_eq!(archives.len(), 1, "one image archive: {archives:?}");
    let images = capture_oci::read_archive(&archives[0]).expect("the archive");
    let name = images[0].name.clone();
    let index = images[0]
        .index
        .clone()
        .expect("the name points at an image index");
    let mut platforms = Vec::new();
    for image in images {
        assert_eq!(image.name, name, "one name over every platform");
        assert_eq!(image.index.as_deref(), Some(index.as_str()));
        let mut files = BTreeMap::new();
        for layer in &image.layers {
            let mut tar = tar::Archive::new(&layer[..]);
            for entry in tar.entries().expect("the layer's entries") {
                let mut entry = entry.expect("an entry");
                if entry.header().entry_type().is_file() {
                    let path = format!("/{}", entry.path().expect("a path").display());
                    let mut data = Vec::new();
                    std::io::Read::read_to_end(&mut entry, &mut data).expect("its content");
                    files.insert(path, data);
                }
            }
        }
        platforms.push(PlatformImage {
            platform: image.platform.clone().expect("a platform"),
            architecture: image.config["architecture"]
                .as_str()
                .unwrap_or_default()
                .to_string(),
            files,
        });
    }
    let architectures: Vec<&str> = platforms.iter().map(|p| p.architecture.as_str()).collect();
    assert_eq!(architectures, ["amd64", "arm64"]);
    (name, index, platforms)
}

/// Where the release publishes the static binary `bin` of `version` for `architecture`.
fn published_binary(release: &Path, bin: &str, version: &str, architecture: &str) -> PathBuf {
    release
        .join("bin")
        .join(format!("{bin}-{version}-linux-{architecture}"))
}

fn sbom(release: &Path, version: &str) -> Value {
    let path = release.join(format!("capture-{version}.cdx.json"));
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    serde_json::from_str(&text).expect("the SBOM is JSON")
}

/// Every component of the SBOM, nested ones too, with the component it is nested in.
fn components(bom: &Value) -> Vec<(&Value, Option<&Value>)> {
    let mut all = Vec::new();
    let mut todo: Vec<(&Value, Option<&Value>)> = bom["components"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|c| (c, None))
        .collect();
    while let Some((c, parent)) = todo.pop() {
        todo.extend(
            c["components"]
                .as_array()
                .into_iter()
                .flatten()
                .map(|n| (n, Some(c))),
        );
        all.push((c, parent));
    }
    all
}

fn sha256_of(component: &Value) -> Option<&str> {
    component["hashes"]
        .as_array()?
        .iter()
        .find(|h| h["alg"] == "SHA-256")?["content"]
        .as_str()
}

#[test]
fn every_file_of_the_release_is_in_its_checksums_and_matches_them() {
    let release = capture_tests::release_dir();
    let out = Command::new("sha256sum")
        .args(["--check", "--strict", "SHA256SUMS"])
        .current_dir(&release)
        .output()
        .expect("sha256sum");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    let sums = std::fs::read_to_string(release.join("SHA256SUMS")).expect("SHA256SUMS");
    let listed: BTreeSet<String> = sums
        .lines()
        .filter_map(|l| l.split_once("  ").map(|(_, f)| f.to_string()))
        .collect();
    let mut present = files_under(&release);
    present.remove("SHA256SUMS");
    assert_eq!(listed, present, "SHA256SUMS lists every file and no other");
    for expected in [
        "RELEASE-NOTES.md",
        "manifests/capture.yaml",
        "share/man/capture.1",
    ] {
        assert!(present.contains(expected), "{expected} in {present:?}");
    }
}

#[test]
fn the_manifest_names_the_image_by_tag_and_digest_and_the_note_by_version() {
    let release = capture_tests::release_dir();
    let (name, digest, platforms) = image(&release);
    let version = name.rsplit_once(':').expect("a tag").1.to_string();
    let manifest = std::fs::read_to_string(release.join("manifests/capture.yaml")).unwrap();
    let images: Vec<&str> = manifest
        .lines()
        .filter_map(|l| l.split_once("image: ").map(|(_, i)| i.trim()))
        .collect();
    assert!(!images.is_empty(), "{manifest}");
    for image in images {
        assert_eq!(image, format!("localhost/capture:{version}@{digest}"));
    }
    // The source tree's manifest names the release it prepares, unpinned.
    let source = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml"),
    )
    .unwrap();
    assert!(
        source.contains(&format!(
            "image: localhost/capture:{}\n",
            env!("CARGO_PKG_VERSION")
        )),
        "deploy/capture.yaml names localhost/capture:{}",
        env!("CARGO_PKG_VERSION")
    );
    let note = std::fs::read_to_string(release.join("RELEASE-NOTES.md")).unwrap();
    assert!(
        note.starts_with(&format!("# capture {version}\n")),
        "{note}"
    );
    assert!(note.contains(&digest), "{note}");
    for platform in &platforms {
        assert!(note.contains(&platform.platform), "{note}");
    }
    // The binaries published beside the image are each platform's own.
    for platform in &platforms {
        for bin in ["capture", "capture-cni"] {
            let path = published_binary(&release, bin, &version, &platform.architecture);
            let published = std::fs::read(&path)
                .unwrap_or_else(|e| panic!("a published binary {}: {e}", path.display()));
            assert!(
                platform.files[&format!("/usr/local/bin/{bin}")] == published,
                "{}",
                path.display()
            );
        }
    }
}

#[test]
fn the_sbom_names_every_file_of_each_platforms_image_with_its_debian_package() {
    let release = capture_tests::release_dir();
    let (name, digest, platforms) = image(&release);
    let version = name.rsplit_once(':').expect("a tag").1;
    let bom = sbom(&release, version);
    assert_eq!(bom["bomFormat"], "CycloneDX");
    assert_eq!(bom["specVersion"], "1.5");
    assert_eq!(bom["metadata"]["component"]["version"], version);
    assert_eq!(
        sha256_of(&bom["metadata"]["component"]),
        digest.strip_prefix("sha256:")
    );
    for platform in &platforms {
        let image = components(&bom)
            .into_iter()
            .map(|(c, _)| c)
            .find(|c| {
                c["type"] == "container"
                    && property(c, "capture:platform") == Some(&platform.platform)
            })
            .unwrap_or_else(|| panic!("no image of {} in the SBOM", platform.platform));
        let held = components(image);
        let by_name: BTreeMap<&str, (&Value, Option<&Value>)> = held
            .into_iter()
            .filter(|(c, _)| c["type"] == "file" || c["type"] == "application")
            .filter_map(|(c, p)| Some((c["name"].as_str()?, (c, p))))
            .collect();
        for (path, data) in &platform.files {
            let file = path.strip_prefix("/usr/local/bin/").unwrap_or(path);
            let (component, package) = by_name.get(file).unwrap_or_else(|| {
                panic!(
                    "{path} of the {} image is not in the SBOM",
                    platform.platform
                )
            });
            assert_eq!(
                sha256_of(component),
                Some(capture_oci::sha256(data).as_str()),
                "{} {path}",
                platform.platform
            );
            if path.starts_with("/usr/local/bin/") {
                continue;
            }
            let package = package.unwrap_or_else(|| panic!("{path} has no Debian package"));
            let purl = package["purl"].as_str().unwrap_or_default();
            assert!(purl.starts_with("pkg:deb/debian/"), "{path}: {package}");
            assert!(
                purl.contains(&format!("arch={}", platform.architecture))
                    || purl.contains("arch=all"),
                "{path}: {purl}"
            );
            assert!(package["version"].as_str().is_some_and(|v| !v.is_empty()));
            assert!(
                package["licenses"]
                    .as_array()
                    .is_some_and(|l| !l.is_empty()),
                "{path}: {package}"
            );
        }
    }
}

fn property<'a>(component: &'a Value, name: &str) -> Option<&'a str> {
    component["properties"]
        .as_array()?
        .iter()
        .find(|p| p["name"] == name)?["value"]
        .as_str()
}

#[test]
fn the_sbom_names_every_crate_each_binary_lists_and_the_kernel_objects() {
    let release = capture_tests::release_dir();
    let (name, _, _) = image(&release);
    let version = name.rsplit_once(':').expect("a tag").1;
    let bom = sbom(&release, version);
    let all = components(&bom);
    let crates: BTreeMap<String, &Value> = all
        .iter()
        .filter_map(|(c, _)| Some((c["purl"].as_str()?.to_string(), *c)))
        .filter(|(purl, _)| purl.starts_with("pkg:cargo/"))
        .collect();
    let lock = std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../Cargo.lock"))
        .expect("Cargo.lock");
    let binaries = ["amd64", "arm64"]
        .iter()
        .flat_map(|a| ["capture", "capture-cni"].map(|bin| (bin, *a)));
    for (bin, architecture) in binaries {
        let path = published_binary(&release, bin, version, architecture);
        let listed = auditable_packages(&path);
        assert!(
            listed.iter().any(|(n, _, _)| n == "aya") || bin == "capture-cni",
            "{bin} lists aya: {listed:?}"
        );
        assert!(
            listed.iter().any(|(n, _, _)| n == "serde_json"),
            "{listed:?}"
        );
        for (crate_name, crate_version, source) in listed {
            let purl = format!("pkg:cargo/{crate_name}@{crate_version}");
            let component = crates
                .get(&purl)
                .unwrap_or_else(|| panic!("{bin} holds {purl}, which the SBOM does not name"));
            assert!(
                component["licenses"]
                    .as_array()
                    .is_some_and(|l| !l.is_empty()),
                "{purl} has a licence: {component}"
            );
            if source == "crates.io" {
                let sum = locked_checksum(&lock, &crate_name, &crate_version);
                assert_eq!(sha256_of(component), sum.as_deref(), "{purl}");
            }
        }
    }
    let objects: Vec<&str> = all
        .iter()
        .filter_map(|(c, _)| c["name"].as_str())
        .filter(|n| n.ends_with(".bpf.o"))
        .collect();
    for object in [
        "capture.bpf.o",
        "netns-cookie.bpf.o",
        "adopt-listeners.bpf.o",
    ] {
        assert!(objects.contains(&object), "{object} in {objects:?}");
    }
}

/// `(name, version, source)` of every package a binary's `.dep-v0` section lists (cargo
/// auditable's format: a zlib stream of JSON).
fn auditable_packages(binary: &Path) -> Vec<(String, String, String)> {
    let json = auditable_info::json_from_file(binary, auditable_info::Limits::default())
        .unwrap_or_else(|e| panic!("{} carries no dependency list: {e}", binary.display()));
    let info: Value = serde_json::from_str(&json).expect("its JSON");
    info["packages"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|p| p["kind"] != "build")
        .map(|p| {
            let field = |k: &str| p[k].as_str().unwrap_or_default().to_string();
            (field("name"), field("version"), field("source"))
        })
        .collect()
}

fn locked_checksum(lock: &str, name: &str, version: &str) -> Option<String> {
    let header = format!("name = \"{name}\"\nversion = \"{version}\"\n");
    let at = lock.find(&header)?;
    let rest = &lock[at..];
    let block = &rest[..rest.find("\n\n").unwrap_or(rest.len())];
    block.lines().find_map(|l| {
        l.strip_prefix("checksum = \"")
            .map(|s| s.trim_end_matches('"').to_string())
    })
}
