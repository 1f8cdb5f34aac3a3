//! The containerd tests' images, written by hand as an OCI image layout archive (no registry, no
//! image builder): one layer holding the test probe and the shared libraries it loads, and three
//! images on it that differ only in what they run — a pause image for the sandbox, an app and a
//! proxy. containerd imports the archive with `ctr images import`.

use std::{io, path::Path, process::Command};

use capture_oci::{Compression, Image, Layer};
use serde_json::json;

/// Where the probe lives inside every image.
pub const PROBE: &str = "/usr/local/bin/capture-probe";
pub const PAUSE_IMAGE: &str = "localhost/capture-test/pause:1";
pub const APP_IMAGE: &str = "localhost/capture-test/app:1";
pub const PROXY_IMAGE: &str = "localhost/capture-test/proxy:1";

/// One test image: its name and the command its config runs.
struct TestImage {
    name: &'static str,
    entrypoint: Vec<String>,
}

fn images() -> Vec<TestImage> {
    let probe = |args: &[&str]| {
        std::iter::once(PROBE)
            .chain(args.iter().copied())
            .map(str::to_string)
            .collect()
    };
    vec![
        TestImage {
            name: PAUSE_IMAGE,
            entrypoint: probe(&["pause"]),
        },
        // The app serves on 8080 and 9090, as the CNI tests' pods do; connections from the app
        // are made with `exec`.
        TestImage {
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
        TestImage {
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
    let images: Vec<Image> = images()
        .into_iter()
        .map(|i| Image {
            name: i.name.to_string(),
            config: json!({"Entrypoint": i.entrypoint, "WorkingDir": "/"}),
        })
        .collect();
    capture_oci::write_archive(out, &layer, Compression::None, 0, None, &images).map(|_| ())
}

/// The layer: the probe without its debug information (a fifteenth of its size, which matters
/// under emulation), the shared libraries the dynamic loader gives it (at the paths it names them
/// by, as regular files), and the directories a container expects. `scratch` holds the stripped
/// probe meanwhile.
fn probe_layer(scratch: &Path) -> io::Result<Layer> {
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
    let mut layer = Layer::new();
    layer.dir("/etc", 0o755);
    layer.dir("/tmp", 0o1777);
    layer.file(PROBE, std::fs::read(scratch)?, 0o755);
    for lib in capture_oci::shared_libraries(&probe)? {
        layer.file(&lib, std::fs::read(std::fs::canonicalize(&lib)?)?, 0o755);
    }
    std::fs::remove_file(scratch)?;
    Ok(layer)
}

/// Importing images into a test containerd.
impl super::Containerd {
    pub(super) fn import_images(&self) {
        let archive = self.dir.join("images.tar");
        write_archive(&archive).expect("writing the test images");
        self.import_archive(&archive);
        let _ = std::fs::remove_file(&archive);
        for image in [PAUSE_IMAGE, APP_IMAGE, PROXY_IMAGE] {
            assert!(
                self.cri().has_image(image).expect("CRI ImageStatus"),
                "{image} is not there after the import"
            );
        }
    }

    /// `ctr images import` of an OCI archive into the CRI's namespace.
    pub fn import_archive(&self, archive: &Path) {
        let archive = archive.to_str().expect("a UTF-8 archive path");
        self.ctr("k8s.io", &["images", "import", archive]);
    }

    /// `ctr ARGS` against this containerd in `namespace`, which must succeed; its stdout.
    pub fn ctr(&self, namespace: &str, args: &[&str]) -> String {
        let out = Command::new("ctr")
            .arg("--address")
            .arg(&self.socket)
            .args(["--namespace", namespace])
            .args(args)
            .output()
            .expect("running ctr (`cargo xtask setup` installs it with containerd)");
        assert!(
            out.status.success(),
            "ctr {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}
