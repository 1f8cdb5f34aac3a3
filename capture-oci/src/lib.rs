//! OCI image layout archives, written directly: no daemon, no registry, no image builder. Every
//! byte follows from the inputs (entries sorted by path and owned by root, one fixed time, gzip
//! without a file name or time stamp), so the same inputs give the same digests. containerd reads
//! the archive with `ctr images import`, skopeo with `oci-archive:`.

mod host;
mod read;
mod write;

use std::{
    collections::BTreeMap,
    io::{self, Write as _},
    path::Path,
};

use serde_json::{json, Value};
use sha2::{Digest as _, Sha256};

pub use self::{
    host::shared_libraries,
    read::{read_archive, ReadImage},
    write::{
        write_archive, write_index_archive, Compression, Image, PlatformImage, Written,
        WrittenIndex,
    },
};

/// One filesystem layer, built up in memory.
#[derive(Default)]
pub struct Layer {
    entries: BTreeMap<String, Entry>,
}

enum Entry {
    Dir(u32),
    File { data: Vec<u8>, mode: u32 },
    Symlink(String),
}

impl Layer {
    #[must_use]
    pub fn new() -> Self {
        Self::default()
    }

    /// A directory with `mode`; its parents get 0755 unless given otherwise.
    pub fn dir(&mut self, path: &str, mode: u32) {
        let path = relative(path);
        self.parents(&path);
        self.entries.insert(path, Entry::Dir(mode));
    }

    pub fn file(&mut self, path: &str, data: Vec<u8>, mode: u32) {
        let path = relative(path);
        self.parents(&path);
        self.entries.insert(path, Entry::File { data, mode });
    }

    pub fn symlink(&mut self, path: &str, target: &str) {
        let path = relative(path);
        self.parents(&path);
        self.entries
            .insert(path, Entry::Symlink(target.to_string()));
    }

    fn parents(&mut self, path: &str) {
        let mut parent = Path::new(path).parent();
        while let Some(p) = parent.filter(|p| !p.as_os_str().is_empty()) {
            self.entries
                .entry(p.to_string_lossy().into_owned())
                .or_insert(Entry::Dir(0o755));
            parent = p.parent();
        }
    }

    /// The layer as a tar stream, every entry stamped with `mtime`. Sorted paths put each
    /// directory before what it holds.
    pub fn tar(&self, mtime: u64) -> io::Result<Vec<u8>> {
        let mut b = tar::Builder::new(Vec::new());
        for (path, entry) in &self.entries {
            match entry {
                Entry::Dir(mode) => append_dir(&mut b, path, *mode, mtime)?,
                Entry::File { data, mode } => append(&mut b, path, data, *mode, mtime)?,
                Entry::Symlink(target) => {
                    let mut h = header(0o777, 0, tar::EntryType::Symlink, mtime);
                    b.append_link(&mut h, path, target)?;
                }
            }
        }
        b.into_inner()
    }
}

fn relative(path: &str) -> String {
    path.trim_start_matches('/')
        .trim_end_matches('/')
        .to_string()
}

fn gzip(data: &[u8]) -> io::Result<Vec<u8>> {
    // No name and time 0 in the header (flate2's defaults, spelled out): nothing but the data
    // decides the bytes.
    let mut gz = flate2::GzBuilder::new()
        .mtime(0)
        .write(Vec::new(), flate2::Compression::best());
    gz.write_all(data)?;
    gz.finish()
}

fn header(mode: u32, size: u64, kind: tar::EntryType, mtime: u64) -> tar::Header {
    let mut h = tar::Header::new_ustar();
    h.set_entry_type(kind);
    h.set_mode(mode);
    h.set_size(size);
    h.set_uid(0);
    h.set_gid(0);
    h.set_mtime(mtime);
    h
}

fn append<W: io::Write>(
    b: &mut tar::Builder<W>,
    path: &str,
    data: &[u8],
    mode: u32,
    mtime: u64,
) -> io::Result<()> {
    let mut h = header(mode, data.len() as u64, tar::EntryType::Regular, mtime);
    b.append_data(&mut h, path, data)
}

fn append_dir<W: io::Write>(
    b: &mut tar::Builder<W>,
    path: &str,
    mode: u32,
    mtime: u64,
) -> io::Result<()> {
    let mut h = header(mode, 0, tar::EntryType::Directory, mtime);
    b.append_data(&mut h, format!("{path}/"), io::empty())
}

/// Lower-case hex SHA-256.
#[must_use]
pub fn sha256(data: &[u8]) -> String {
    Sha256::digest(data)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

fn descriptor(media_type: &str, blob: &[u8]) -> Value {
    json!({"mediaType": media_type, "digest": format!("sha256:{}", sha256(blob)), "size": blob.len()})
}

/// This machine's architecture as OCI names it.
#[must_use]
pub fn oci_architecture() -> &'static str {
    match std::env::consts::ARCH {
        "x86_64" => "amd64",
        "aarch64" => "arm64",
        other => other,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(tar: &[u8]) -> Vec<(String, tar::EntryType, u64)> {
        let mut a = tar::Archive::new(tar);
        a.entries()
            .unwrap()
            .map(|e| {
                let e = e.unwrap();
                let h = e.header();
                (
                    e.path().unwrap().to_string_lossy().into_owned(),
                    h.entry_type(),
                    h.mtime().unwrap(),
                )
            })
            .collect()
    }

    #[test]
    fn parents_come_first_and_every_entry_has_the_given_time() {
        let mut l = Layer::new();
        l.file("/usr/local/bin/capture", b"x".to_vec(), 0o755);
        l.symlink("/bin", "usr/bin");
        l.dir("/tmp", 0o1777);
        let tar = l.tar(1_700_000_000).unwrap();
        let got: Vec<String> = names(&tar).into_iter().map(|(n, _, _)| n).collect();
        assert_eq!(
            got,
            [
                "bin",
                "tmp/",
                "usr/",
                "usr/local/",
                "usr/local/bin/",
                "usr/local/bin/capture"
            ]
        );
        assert!(names(&tar).iter().all(|(_, _, t)| *t == 1_700_000_000));
    }

    #[test]
    fn the_same_inputs_give_the_same_bytes_whatever_the_insertion_order() {
        let build = |order: &[usize]| {
            let mut l = Layer::new();
            for i in order {
                l.file(&format!("/f{i}"), vec![*i as u8; 1000], 0o644);
            }
            let dir = std::env::temp_dir().join(format!("capture-oci-{}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let out = dir.join(format!("{order:?}.tar"));
            let image = Image {
                name: "localhost/t:1".into(),
                config: json!({"Entrypoint": ["/f1"]}),
            };
            let w = write_archive(&out, &l, Compression::Gzip, 0, None, &[image]).unwrap();
            let bytes = std::fs::read(&out).unwrap();
            std::fs::remove_dir_all(&dir).unwrap();
            (w.manifests, bytes)
        };
        let (a, bytes_a) = build(&[1, 2, 3]);
        let (b, bytes_b) = build(&[3, 1, 2]);
        assert_eq!(a, b);
        assert_eq!(bytes_a, bytes_b);
        assert!(a[0].1.starts_with("sha256:") && a[0].1.len() == 71, "{a:?}");
    }

    #[test]
    fn an_archive_reads_back_as_written() {
        let mut l = Layer::new();
        l.file("/usr/bin/x", b"hello".to_vec(), 0o755);
        l.symlink("/bin", "usr/bin");
        let dir = std::env::temp_dir().join(format!("capture-oci-read-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("a.tar");
        let image = |name: &str| Image {
            name: name.into(),
            config: json!({"Entrypoint": ["/usr/bin/x"]}),
        };
        let w = write_archive(
            &out,
            &l,
            Compression::Gzip,
            7,
            Some("2026-12-01T00:00:00+00:00"),
            &[image("localhost/a:1"), image("localhost/b:2")],
        )
        .unwrap();
        let read = read_archive(&out).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(read.len(), 2);
        assert_eq!(read[1].name, "localhost/b:2");
        assert_eq!(read[1].digest, w.manifests[1].1);
        assert_eq!(read[0].config["created"], "2026-12-01T00:00:00+00:00");
        assert_eq!(read[0].layers, vec![l.tar(7).unwrap()]);
    }

    #[test]
    fn writing_again_leaves_a_link_to_the_previous_archive_as_it_was() {
        let dir = std::env::temp_dir().join(format!("capture-oci-relink-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("image.tar");
        let write = |content: &[u8]| {
            let mut l = Layer::new();
            l.file("/f", content.to_vec(), 0o644);
            let image = Image {
                name: "localhost/t:1".into(),
                config: json!({}),
            };
            write_archive(&out, &l, Compression::None, 0, None, &[image]).unwrap();
        };
        write(b"first");
        let published = dir.join("published.tar");
        std::fs::hard_link(&out, &published).unwrap();
        let before = std::fs::read(&published).unwrap();
        write(b"second");
        let (after, rewritten) = (
            std::fs::read(&published).unwrap(),
            std::fs::read(&out).unwrap(),
        );
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(
            after, before,
            "the published link still holds the first archive"
        );
        assert_ne!(rewritten, before, "the archive itself is the second");
    }

    #[test]
    fn an_index_names_one_image_per_platform_and_reads_back_by_platform() {
        let mut amd = Layer::new();
        amd.file("/usr/bin/x", b"amd64".to_vec(), 0o755);
        let mut arm = Layer::new();
        arm.file("/usr/bin/x", b"arm64".to_vec(), 0o755);
        let dir = std::env::temp_dir().join(format!("capture-oci-index-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let out = dir.join("multi.tar");
        let config = json!({"Entrypoint": ["/usr/bin/x"]});
        let written = write_index_archive(
            &out,
            "localhost/multi:1",
            Compression::Gzip,
            7,
            None,
            &[
                PlatformImage {
                    architecture: "amd64",
                    variant: None,
                    layer: &amd,
                    config: config.clone(),
                },
                PlatformImage {
                    architecture: "arm64",
                    variant: Some("v8"),
                    layer: &arm,
                    config,
                },
            ],
        )
        .unwrap();
        let read = read_archive(&out).unwrap();
        let mut layout = tar::Archive::new(std::fs::File::open(&out).unwrap());
        let index: Value = layout
            .entries()
            .unwrap()
            .map(Result::unwrap)
            .find(|e| e.path().unwrap().to_string_lossy() == "index.json")
            .map(|e| serde_json::from_reader(e).unwrap())
            .unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        // The name points at the index; the index entries carry the platforms.
        assert_eq!(index["manifests"].as_array().unwrap().len(), 1);
        assert_eq!(
            index["manifests"][0]["mediaType"],
            "application/vnd.oci.image.index.v1+json"
        );
        assert_eq!(index["manifests"][0]["digest"], written.index.as_str());
        assert_eq!(read.len(), 2);
        for (image, (platform, digest, _)) in read.iter().zip(&written.manifests) {
            assert_eq!(image.name, "localhost/multi:1");
            assert_eq!(image.index.as_deref(), Some(written.index.as_str()));
            assert_eq!(image.platform.as_deref(), Some(platform.as_str()));
            assert_eq!(&image.digest, digest);
        }
        assert_eq!(read[1].platform.as_deref(), Some("linux/arm64/v8"));
        assert_eq!(read[1].config["architecture"], "arm64");
        assert_eq!(read[1].config["variant"], "v8");
        assert_eq!(read[1].layers, vec![arm.tar(7).unwrap()]);
        assert_eq!(read[0].config["architecture"], "amd64");
        assert_eq!(read[0].layers, vec![amd.tar(7).unwrap()]);
    }

    #[test]
    fn a_different_time_gives_a_different_digest() {
        let mut l = Layer::new();
        l.file("/f", b"x".to_vec(), 0o644);
        assert_ne!(sha256(&l.tar(0).unwrap()), sha256(&l.tar(1).unwrap()));
    }
}
