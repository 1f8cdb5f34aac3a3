//! The containerd tests' images, written by hand as an OCI image layout archive (no registry, no
//! image builder): one layer holding the test probe and the shared libraries it loads, and three
//! images on it that differ only in what they run — a pause image for the sandbox, an app and a
//! proxy. containerd imports the archive with `ctr images import`.

use std::{
    io::{self, Write as _},
    path::{Path, PathBuf},
    process::Command,
};

use serde_json::json;
use sha2::{Digest as _, Sha256};

/// Where the probe lives inside every image.
pub const PROBE: &str = "/usr/local/bin/capture-probe";
pub const PAUSE_IMAGE: &str = "localhost/capture-test/pause:1";
pub const APP_IMAGE: &str = "localhost/capture-test/app:1";
pub const PROXY_IMAGE: &str = "localhost/capture-test/proxy:1";

/// One image: its name and the command its config runs.
struct Image {
    name: &'static str,
    entrypoint: Vec<String>,
}

fn images() -> Vec<Image> {
    let probe = |args: &[&str]| {
        std::iter::once(PROBE)
            .chain(args.iter().copied())
            .map(str::to_string)
            .collect()
    };
    vec![
        Image {
            name: PAUSE_IMAGE,
            entrypoint: probe(&["pause"]),
        },
        // The app serves on 8080 and 9090, as the CNI tests' pods do; connections from the app
        // are made with `exec`.
        Image {
            name: APP_IMAGE,
            entrypoint: probe(&[
                "serve",
                "--tcp",
                "app=0.0.0.0:8080",
                "--tcp",
                "app=0.0.0.0:9090",
            ]),
        },
        // The proxy's outbound and inbound listeners, as Envoy's under Istio.
        Image {
            name: PROXY_IMAGE,
            entrypoint: probe(&[
                "serve",
                "--tcp",
                "outbound=0.0.0.0:15001",
                "--tcp",
                "inbound=0.0.0.0:15006",
            ]),
        },
    ]
}

/// Writes the archive of every test image to `out`.
pub fn write_archive(out: &Path) -> io::Result<()> {
    let layer = probe_layer(&out.with_extension("probe"))?;
    let layer_digest = sha256(&layer);
    let mut blobs: Vec<(String, Vec<u8>)> = vec![(layer_digest.clone(), layer)];
    let mut manifests = Vec::new();
    for image in images() {
        let config = serde_json::to_vec(&json!({
            "architecture": oci_architecture(),
            "os": "linux",
            "config": {"Entrypoint": image.entrypoint, "WorkingDir": "/"},
            "rootfs": {"type": "layers", "diff_ids": [format!("sha256:{layer_digest}")]},
        }))?;
        let manifest = serde_json::to_vec(&json!({
            "schemaVersion": 2,
            "mediaType": "application/vnd.oci.image.manifest.v1+json",
            "config": descriptor("application/vnd.oci.image.config.v1+json", &config),
            "layers": [descriptor("application/vnd.oci.image.layer.v1.tar", &blobs[0].1)],
        }))?;
        let mut entry = descriptor("application/vnd.oci.image.manifest.v1+json", &manifest);
        let tag = image.name.rsplit_once(':').map_or("latest", |(_, t)| t);
        entry["annotations"] = json!({
            "io.containerd.image.name": image.name,
            "org.opencontainers.image.ref.name": tag,
        });
        manifests.push(entry);
        blobs.push((sha256(&config), config));
        blobs.push((sha256(&manifest), manifest));
    }
    let index = serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": manifests}))?;

    let mut archive = tar::Builder::new(std::fs::File::create(out)?);
    append(
        &mut archive,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        0o644,
    )?;
    append(&mut archive, "index.json", &index, 0o644)?;
    append_dir(&mut archive, "blobs")?;
    append_dir(&mut archive, "blobs/sha256")?;
    for (digest, blob) in &blobs {
        append(&mut archive, &format!("blobs/sha256/{digest}"), blob, 0o644)?;
    }
    archive.into_inner()?.flush()
}

/// The layer: the probe without its debug information (a fifteenth of its size, which matters
/// under emulation), the shared libraries the dynamic loader gives it (at the paths it names them
/// by, as regular files), and the directories a container expects. `scratch` holds the stripped
/// probe meanwhile.
fn probe_layer(scratch: &Path) -> io::Result<Vec<u8>> {
    let probe = crate::probe::probe_bin();
    let out = Command::new("strip")
        .arg("--strip-debug")
        .arg("-o")
        .arg(scratch)
        .arg(&probe)
        .output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "strip {}: {}",
            probe.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    let mut files: Vec<(String, PathBuf, u32)> = vec![(
        PROBE.trim_start_matches('/').to_string(),
        scratch.to_path_buf(),
        0o755,
    )];
    for lib in shared_libraries(&probe)? {
        let real = std::fs::canonicalize(&lib)?;
        files.push((lib.trim_start_matches('/').to_string(), real, 0o755));
    }
    let mut layer = tar::Builder::new(Vec::new());
    let mut dirs: Vec<String> = vec!["etc".into(), "tmp".into()];
    for (path, _, _) in &files {
        let mut parent = Path::new(path).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            dirs.push(p.to_string_lossy().into_owned());
            parent = p.parent();
        }
    }
    dirs.sort();
    dirs.dedup();
    for dir in &dirs {
        append_dir(&mut layer, dir)?;
    }
    for (path, source, mode) in &files {
        append(&mut layer, path, &std::fs::read(source)?, *mode)?;
    }
    std::fs::remove_file(scratch)?;
    layer.into_inner()
}

/// What `ldd` says `binary` loads, by the paths the loader uses.
fn shared_libraries(binary: &Path) -> io::Result<Vec<String>> {
    let out = Command::new("ldd").arg(binary).output()?;
    if !out.status.success() {
        return Err(io::Error::other(format!(
            "ldd {}: {}",
            binary.display(),
            String::from_utf8_lossy(&out.stderr)
        )));
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|line| {
            // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` or `/lib64/ld-linux… (0x…)`;
            // the vDSO has no file.
            let path = line.split("=>").last()?.split_whitespace().next()?;
            path.starts_with('/').then(|| path.to_string())
        })
        .collect())
}

fn header(mode: u32, size: u64, kind: tar::EntryType) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    // A fixed time: the same inputs give the same digests.
    h.set_mtime(0);
    h
}

fn append<W: io::Write>(
    b: &mut tar::Builder<W>,
    path: &str,
    data: &[u8],
    mode: u32,
) -> io::Result<()> {
    let mut h = header(mode, data.len() as u64, tar::EntryType::Regular);
    b.append_data(&mut h, path, data)
}

fn append_dir<W: io::Write>(b: &mut tar::Builder<W>, path: &str) -> io::Result<()> {
    let mode = if path == "tmp" { 0o1777 } else { 0o755 };
    let mut h = header(mode, 0, tar::EntryType::Directory);
    b.append_data(&mut h, format!("{path}/"), io::empty())
}

fn sha256(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn descriptor(media_type: &str, blob: &[u8]) -> serde_json::Value {
    json!({"mediaType": media_type, "digest": format!("sha256:{}", sha256(blob)), "size": blob.len()})
}

fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}
