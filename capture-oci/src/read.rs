//! Reading an archive back, every blob checked against its digest.

use std::{collections::BTreeMap, io, path::Path};

use serde_json::Value;

use crate::sha256;

/// One image read back from an archive.
pub struct ReadImage {
    /// `io.containerd.image.name`.
    pub name: String,
    /// `sha256:…` of its manifest.
    pub digest: String,
    /// The image index the name points at, when it points at one (a multi-platform image).
    pub index: Option<String>,
    /// `linux/arm64/v8` as the index entry says it, when the image is one of an index.
    pub platform: Option<String>,
    /// The whole image config (architecture, os, config, rootfs, ...).
    pub config: Value,
    /// Its layers, uncompressed, in order.
    pub layers: Vec<Vec<u8>>,
}

/// Reads every image of an OCI archive (each platform's of an image index), checking each blob
/// against its digest.
pub fn read_archive(path: &Path) -> io::Result<Vec<ReadImage>> {
    let mut files: BTreeMap<String, Vec<u8>> = BTreeMap::new();
    let mut archive = tar::Archive::new(std::fs::File::open(path)?);
    for entry in archive.entries()? {
        let mut entry = entry?;
        let name = entry.path()?.to_string_lossy().into_owned();
        let mut data = Vec::new();
        io::Read::read_to_end(&mut entry, &mut data)?;
        files.insert(name, data);
    }
    let layout = Layout { files };
    let index: Value = serde_json::from_slice(
        layout
            .files
            .get("index.json")
            .ok_or_else(|| invalid("no index.json".into()))?,
    )?;
    let mut images = Vec::new();
    for entry in index["manifests"].as_array().into_iter().flatten() {
        let name = entry["annotations"]["io.containerd.image.name"]
            .as_str()
            .unwrap_or_default()
            .to_string();
        let document: Value = serde_json::from_slice(layout.blob(entry)?)?;
        if entry["mediaType"].as_str() == Some("application/vnd.oci.image.index.v1+json") {
            for platform_entry in document["manifests"].as_array().into_iter().flatten() {
                let mut image = layout.image(&name, platform_entry)?;
                image.index = Some(text(&entry["digest"]));
                let platform = &platform_entry["platform"];
                let mut said = format!(
                    "{}/{}",
                    text(&platform["os"]),
                    text(&platform["architecture"])
                );
                if let Some(variant) = platform["variant"].as_str() {
                    said = format!("{said}/{variant}");
                }
                image.platform = Some(said);
                images.push(image);
            }
        } else {
            images.push(layout.image(&name, entry)?);
        }
    }
    Ok(images)
}

struct Layout {
    files: BTreeMap<String, Vec<u8>>,
}

impl Layout {
    fn blob(&self, descriptor: &Value) -> io::Result<&Vec<u8>> {
        let digest = descriptor["digest"].as_str().unwrap_or_default();
        let hex = digest.strip_prefix("sha256:").unwrap_or_default();
        let data = self
            .files
            .get(&format!("blobs/sha256/{hex}"))
            .ok_or_else(|| invalid(format!("no blob {digest}")))?;
        if sha256(data) != hex {
            return Err(invalid(format!("blob {digest} does not match its digest")));
        }
        Ok(data)
    }

    /// The image a manifest descriptor names.
    fn image(&self, name: &str, entry: &Value) -> io::Result<ReadImage> {
        let manifest: Value = serde_json::from_slice(self.blob(entry)?)?;
        let config: Value = serde_json::from_slice(self.blob(&manifest["config"])?)?;
        let mut layers = Vec::new();
        for layer in manifest["layers"].as_array().into_iter().flatten() {
            let data = self.blob(layer)?;
            if layer["mediaType"]
                .as_str()
                .is_some_and(|m| m.ends_with("+gzip"))
            {
                let mut tar = Vec::new();
                io::Read::read_to_end(&mut flate2::read::GzDecoder::new(&data[..]), &mut tar)?;
                layers.push(tar);
            } else {
                layers.push(data.clone());
            }
        }
        Ok(ReadImage {
            name: name.to_string(),
            digest: text(&entry["digest"]),
            index: None,
            platform: None,
            config,
            layers,
        })
    }
}

fn text(value: &Value) -> String {
    value.as_str().unwrap_or_default().to_string()
}

fn invalid(what: String) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what)
}
