//! The node agent's image (`cargo xtask image`; `cargo xtask test` builds it before the tests):
//! the archive names one image of this version, its binaries are static, and what the agent runs
//! in its container runs from the image's own root: both iptables variants write and read back
//! the sidecar's rules in a pod netns, `ip` and `nsenter` start, capture answers.

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use capture_tests::guards::{in_netns, run, NetnsGuard};

/// The image's layer unpacked into a scratch directory with the host's /proc mounted in it, as a
/// container runtime would (iptables-legacy lists its tables there), all removed on drop.
struct Root {
    dir: PathBuf,
}

impl Root {
    fn unpack() -> (Self, capture_oci::ReadImage) {
        let archive = capture_tests::image_archive();
        let mut images = capture_oci::read_archive(&archive)
            .unwrap_or_else(|e| panic!("reading {}: {e}", archive.display()));
        assert_eq!(images.len(), 1, "one image in {}", archive.display());
        let image = images.remove(0);
        let dir = std::env::temp_dir().join(capture_tests::unique("capture-image-root"));
        std::fs::create_dir_all(&dir).expect("scratch directory");
        for layer in &image.layers {
            let mut tar = tar::Archive::new(&layer[..]);
            tar.set_preserve_permissions(true);
            tar.unpack(&dir).expect("unpacking the layer");
        }
        let proc = dir.join("proc");
        std::fs::create_dir_all(&proc).expect("proc mount point");
        nix::mount::mount(
            Some("proc"),
            &proc,
            Some("proc"),
            nix::mount::MsFlags::empty(),
            None::<&str>,
        )
        .expect("mounting /proc in the image root");
        (Self { dir }, image)
    }

    /// Runs `argv` with the image's root as `/`, in `netns` if given.
    fn run(&self, netns: Option<&NetnsGuard>, argv: &[&str], stdin: &str) -> Output {
        let mut cmd = match netns {
            Some(ns) => in_netns(&ns.path(), "chroot"),
            None => Command::new("chroot"),
        };
        cmd.arg(&self.dir)
            .args(argv)
            .env_clear()
            .env("PATH", "/usr/local/bin:/usr/sbin:/usr/bin")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().expect("chroot");
        std::io::Write::write_all(&mut child.stdin.take().expect("stdin"), stdin.as_bytes())
            .expect("writing stdin");
        child.wait_with_output().expect("waiting")
    }

    fn run_ok(&self, netns: Option<&NetnsGuard>, argv: &[&str], stdin: &str) -> String {
        let out = self.run(netns, argv, stdin);
        assert!(
            out.status.success(),
            "{argv:?} in the image's root: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Root {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.dir.join("proc"), nix::mount::MntFlags::MNT_DETACH);
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

#[test]
fn the_archive_holds_one_image_of_this_version_with_static_binaries() {
    let (root, image) = Root::unpack();
    // Tagged with what its binary says it is: the release on a tagged commit, else a
    // development version of it that names the commit (capture/build.rs).
    let said: serde_json::Value = serde_json::from_str(&root.run_ok(
        None,
        &["/usr/local/bin/capture", "version", "--json"],
        "",
    ))
    .expect("capture version --json");
    let version = said["version"].as_str().expect("a version");
    assert_eq!(image.name, format!("localhost/capture:{version}"));
    let commit = said["commit"].as_str().expect("a commit");
    assert!(
        version == env!("CARGO_PKG_VERSION")
            || version == format!("{}-dev.{}", env!("CARGO_PKG_VERSION"), &commit[..12]),
        "{version} (commit {commit})"
    );
    assert_eq!(
        image.config["config"]["Labels"]["org.opencontainers.image.version"],
        version
    );
    assert_eq!(image.config["os"], "linux");
    assert_eq!(
        image.config["config"]["Entrypoint"][0],
        "/usr/local/bin/capture"
    );
    let labels = &image.config["config"]["Labels"];
    let packages = labels["dev.capture.debian-packages"]
        .as_str()
        .unwrap_or_default();
    for package in ["iptables=", "iproute2=", "util-linux=", "libc6="] {
        assert!(
            packages.split(' ').any(|p| p.starts_with(package)),
            "{package} in {packages}"
        );
    }
    for bin in ["capture", "capture-cni"] {
        let path = root.dir.join("usr/local/bin").join(bin);
        let libs = capture_oci::shared_libraries(&path).expect("ldd");
        assert!(libs.is_empty(), "{bin} loads {libs:?}");
    }
    // Nothing but what the agent runs: no shell, no package manager.
    for absent in [
        "usr/bin/sh",
        "bin/sh",
        "usr/bin/bash",
        "usr/bin/apt-get",
        "usr/bin/dpkg",
    ] {
        assert!(!root.dir.join(absent).exists(), "{absent} in the image");
    }
}

#[test]
fn capture_ip_and_nsenter_run_from_the_image_root() {
    let (root, _) = Root::unpack();
    let version = root.run_ok(None, &["/usr/local/bin/capture", "--version"], "");
    assert!(version.contains(env!("CARGO_PKG_VERSION")), "{version}");
    // Without CNI_COMMAND the plugin says what it is (on stderr), as the reference plugins do.
    let out = root.run(None, &["/usr/local/bin/capture-cni"], "");
    let about = String::from_utf8_lossy(&out.stderr);
    assert!(about.contains("CNI protocol versions supported"), "{about}");
    assert!(root
        .run_ok(None, &["/usr/bin/ip", "-V"], "")
        .contains("iproute2"));
    assert!(root
        .run_ok(None, &["/usr/bin/nsenter", "--version"], "")
        .contains("util-linux"));
}

#[test]
fn both_iptables_variants_write_and_read_back_the_sidecar_rules_in_a_pod_netns() {
    let (root, _) = Root::unpack();
    let rules = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../capture-user/src/iptables/testdata/rules-default-sidecar.v4.txt"),
    )
    .expect("the sidecar rules fixture");
    for variant in ["nft", "legacy"] {
        let pod = NetnsGuard::new("image-rules");
        if variant == "legacy" {
            // A node on legacy iptables has the nat table's module loaded (its kube-proxy rules
            // live there); the image has no modprobe to load it, as a container has none.
            run(in_netns(&pod.path(), "iptables-legacy").args(["-t", "nat", "-n", "-L"]));
        }
        root.run_ok(
            Some(&pod),
            &[&format!("/usr/sbin/iptables-{variant}-restore")],
            &rules,
        );
        let saved = root.run_ok(
            Some(&pod),
            &[&format!("/usr/sbin/iptables-{variant}-save")],
            "",
        );
        for rule in [
            "-A ISTIO_OUTPUT -m owner --uid-owner 1337 -j RETURN",
            "-A ISTIO_REDIRECT -p tcp -j REDIRECT --to-ports 15001",
        ] {
            assert!(saved.contains(rule), "{variant}: {rule} in\n{saved}");
        }
        let v6 = root.run_ok(
            Some(&pod),
            &[&format!("/usr/sbin/ip6tables-{variant}-save")],
            "",
        );
        assert!(!v6.contains("ISTIO"), "{variant}: no IPv6 rules written");
        // The unsuffixed names are the nft variant, as Debian's defaults.
        if variant == "nft" {
            let plain = root.run_ok(Some(&pod), &["/usr/sbin/iptables-save"], "");
            assert!(plain.contains("ISTIO_OUTPUT"), "{plain}");
        }
    }
}
