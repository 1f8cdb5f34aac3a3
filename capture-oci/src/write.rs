//! Writing an archive: one image per name sharing a layer, or one name over an index of
//! per-platform images.

use std::{collections::BTreeMap, io, io::Write as _, path::Path};

use serde_json::{json, Value};

use crate::{append, append_dir, descriptor, gzip, oci_architecture, sha256, Layer};

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const INDEX: &str = "application/vnd.oci.image.index.v1+json";

/// How the layer is stored in the archive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Compression {
    /// A plain tar: cheapest to write and to unpack (the containerd tests).
    None,
    /// gzip at its best level (what registries and runtimes expect of a shipped image).
    Gzip,
}

/// One image of the archive: its name (as containerd will know it) and the image config's
/// `config` object (Entrypoint, Env, Labels, ...).
pub struct Image {
    pub name: String,
    pub config: Value,
}

/// What `write_archive` wrote.
#[derive(Debug)]
pub struct Written {
    /// Each image's name and manifest digest (`sha256:…`), in the order given.
    pub manifests: Vec<(String, String)>,
    /// The layer's stored (possibly compressed) size, bytes.
    pub layer_bytes: u64,
    /// The archive's size, bytes.
    pub archive_bytes: u64,
}

/// Writes an OCI image layout archive to `out`: `layer` (stamped with `mtime`, seconds since the
/// epoch) shared by every image in `images`, each for this machine's architecture. `created`
/// (RFC 3339) goes into each image config.
pub fn write_archive(
    out: &Path,
    layer: &Layer,
    compression: Compression,
    mtime: u64,
    created: Option<&str>,
    images: &[Image],
) -> io::Result<Written> {
    let mut blobs = Vec::new();
    let platform = Platform {
        architecture: oci_architecture(),
        variant: None,
    };
    let stored = store_layer(layer, compression, mtime, &mut blobs)?;
    let mut entries = Vec::new();
    let mut manifests = Vec::new();
    for image in images {
        let manifest = manifest(&stored, &platform, &image.config, created, &mut blobs)?;
        manifests.push((image.name.clone(), digest_of(&manifest)));
        entries.push(named(manifest, &image.name));
    }
    let archive_bytes = write_layout(out, &entries, &blobs, mtime)?;
    Ok(Written {
        manifests,
        layer_bytes: stored.bytes,
        archive_bytes,
    })
}

/// One platform's image of a multi-platform archive.
pub struct PlatformImage<'a> {
    /// OCI's architecture: `amd64`, `arm64`.
    pub architecture: &'a str,
    /// `v8` for arm64, as registries' images say.
    pub variant: Option<&'a str>,
    pub layer: &'a Layer,
    /// The image config's `config` object.
    pub config: Value,
}

/// What `write_index_archive` wrote.
#[derive(Debug)]
pub struct WrittenIndex {
    /// The image index's digest: what the name points at (and a `tag@digest` reference pins).
    pub index: String,
    /// Each platform's `(linux/<arch>[/<variant>], manifest digest, stored layer bytes)`, in the
    /// order given.
    pub manifests: Vec<(String, String, u64)>,
    pub archive_bytes: u64,
}

/// Writes an OCI image layout archive whose one name points at an image index of `images`, one
/// manifest per platform with the index entry's `platform` set, as a runtime pulling or importing
/// it matches its own platform against.
pub fn write_index_archive(
    out: &Path,
    name: &str,
    compression: Compression,
    mtime: u64,
    created: Option<&str>,
    images: &[PlatformImage<'_>],
) -> io::Result<WrittenIndex> {
    let mut blobs = Vec::new();
    let mut entries = Vec::new();
    let mut manifests = Vec::new();
    for image in images {
        let platform = Platform {
            architecture: image.architecture,
            variant: image.variant,
        };
        let stored = store_layer(image.layer, compression, mtime, &mut blobs)?;
        let mut entry = manifest(&stored, &platform, &image.config, created, &mut blobs)?;
        entry["platform"] = platform.json();
        manifests.push((platform.name(), digest_of(&entry), stored.bytes));
        entries.push(entry);
    }
    let index = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": INDEX,
        "manifests": entries,
    }))?;
    let entry = descriptor(INDEX, &index);
    blobs.push(index);
    let index_digest = digest_of(&entry);
    let archive_bytes = write_layout(out, &[named(entry, name)], &blobs, mtime)?;
    Ok(WrittenIndex {
        index: index_digest,
        manifests,
        archive_bytes,
    })
}

struct Platform<'a> {
    architecture: &'a str,
    variant: Option<&'a str>,
}

impl Platform<'_> {
    fn json(&self) -> Value {
        let mut platform = json!({"architecture": self.architecture, "os": "linux"});
        if let Some(variant) = self.variant {
            platform["variant"] = json!(variant);
        }
        platform
    }

    fn name(&self) -> String {
        match self.variant {
            Some(variant) => format!("linux/{}/{variant}", self.architecture),
            None => format!("linux/{}", self.architecture),
        }
    }
}

/// A layer as stored: its descriptor, its uncompressed digest and its stored size.
struct StoredLayer {
    descriptor: Value,
    diff_id: String,
    bytes: u64,
}

fn store_layer(
    layer: &Layer,
    compression: Compression,
    mtime: u64,
    blobs: &mut Vec<Vec<u8>>,
) -> io::Result<StoredLayer> {
    let tar = layer.tar(mtime)?;
    let diff_id = sha256(&tar);
    let (blob, media_type) = match compression {
        Compression::None => (tar, "application/vnd.oci.image.layer.v1.tar"),
        Compression::Gzip => (gzip(&tar)?, "application/vnd.oci.image.layer.v1.tar+gzip"),
    };
    let stored = StoredLayer {
        descriptor: descriptor(media_type, &blob),
        diff_id,
        bytes: blob.len() as u64,
    };
    blobs.push(blob);
    Ok(stored)
}

/// An image's config and manifest, added to `blobs`; returns the manifest's descriptor.
fn manifest(
    layer: &StoredLayer,
    platform: &Platform<'_>,
    config: &Value,
    created: Option<&str>,
    blobs: &mut Vec<Vec<u8>>,
) -> io::Result<Value> {
    let mut image_config = platform.json();
    image_config["config"] = config.clone();
    image_config["rootfs"] =
        json!({"type": "layers", "diff_ids": [format!("sha256:{}", layer.diff_id)]});
    if let Some(created) = created {
        image_config["created"] = json!(created);
    }
    let image_config = serde_json::to_vec(&image_config)?;
    let manifest = serde_json::to_vec(&json!({
        "schemaVersion": 2,
        "mediaType": MANIFEST,
        "config": descriptor("application/vnd.oci.image.config.v1+json", &image_config),
        "layers": [layer.descriptor],
    }))?;
    let entry = descriptor(MANIFEST, &manifest);
    blobs.push(image_config);
    blobs.push(manifest);
    Ok(entry)
}

fn digest_of(descriptor: &Value) -> String {
    descriptor["digest"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// `descriptor` annotated with the name containerd imports it as.
fn named(mut descriptor: Value, name: &str) -> Value {
    let tag = name.rsplit_once(':').map_or("latest", |(_, t)| t);
    descriptor["annotations"] = json!({
        "io.containerd.image.name": name,
        "org.opencontainers.image.ref.name": tag,
    });
    descriptor
}

/// The layout itself: `oci-layout`, `index.json` of `entries`, and every blob once by digest.
fn write_layout(out: &Path, entries: &[Value], blobs: &[Vec<u8>], mtime: u64) -> io::Result<u64> {
    let index = serde_json::to_vec(&json!({"schemaVersion": 2, "manifests": entries}))?;
    // Written beside `out` and renamed over it: a new file, never the old one rewritten, so a
    // link to the previous archive (a release's copy of it) keeps the bytes it was published with.
    let partial = out.with_extension("partial");
    let mut archive = tar::Builder::new(std::fs::File::create(&partial)?);
    append(
        &mut archive,
        "oci-layout",
        br#"{"imageLayoutVersion":"1.0.0"}"#,
        0o644,
        mtime,
    )?;
    append(&mut archive, "index.json", &index, 0o644, mtime)?;
    append_dir(&mut archive, "blobs", 0o755, mtime)?;
    append_dir(&mut archive, "blobs/sha256", 0o755, mtime)?;
    // Blobs by digest, each once (images may share a layer or a config).
    let mut by_digest: BTreeMap<String, &[u8]> = BTreeMap::new();
    for blob in blobs {
        by_digest.insert(sha256(blob), blob);
    }
    for (digest, blob) in by_digest {
        append(
            &mut archive,
            &format!("blobs/sha256/{digest}"),
            blob,
            0o644,
            mtime,
        )?;
    }
    archive.into_inner()?.flush()?;
    std::fs::rename(&partial, out)?;
    Ok(std::fs::metadata(out)?.len())
}
