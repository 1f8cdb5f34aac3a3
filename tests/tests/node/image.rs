//! The node agent's image (`cargo xtask image`; `cargo xtask test` builds it before the tests):
//! the archive names one image of this version over an index of two platforms (amd64, arm64),
//! its binaries are static, and what the agent runs in its container runs from the image's own
//! root: both iptables variants write and read back the sidecar's rules in a pod netns, `ip` and
//! `nsenter` start, capture answers. The other platform's root is run the same way under qemu's
//! user-mode emulation (no binfmt registration: qemu is named on each command line).

use std::{
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use capture_tests::guards::{in_netns, run, NetnsGuard};

/// The platforms of the image: this machine's first.
const PLATFORMS: [&str; 2] = ["linux/amd64", "linux/arm64/v8"];

/// qemu's user-mode emulator of another architecture's binaries (Debian's qemu-user), by the
/// OCI architecture it runs.
fn emulator(architecture: &str) -> &'static str {
    match architecture {
        "arm64" => "qemu-aarch64",
        _ => "qemu-x86_64",
    }
}

/// The image's layer of one platform unpacked into a scratch directory with the host's /proc
/// mounted in it, as a container runtime would (iptables-legacy lists its tables there), all
/// removed on drop.
struct Root {
    dir: PathBuf,
    /// How its programs run here: None for this machine's architecture (chroot), else qemu's
    /// emulator of it, with the root as the prefix of every absolute path the program opens.
    emulator: Option<&'static str>,
}

impl Root {
    /// This machine's platform.
    fn unpack() -> (Self, capture_oci::ReadImage) {
        Self::unpack_architecture(capture_oci::oci_architecture())
    }

    fn unpack_architecture(architecture: &str) -> (Self, capture_oci::ReadImage) {
        let archive = capture_tests::image_archive();
        let images = capture_oci::read_archive(&archive)
            .unwrap_or_else(|e| panic!("reading {}: {e}", archive.display()));
        let platforms: Vec<&str> = images
            .iter()
            .filter_map(|i| i.platform.as_deref())
            .collect();
        assert_eq!(
            platforms,
            PLATFORMS,
            "the platforms of {}",
            archive.display()
        );
        let image = images
            .into_iter()
            .find(|i| i.config["architecture"] == architecture)
            .unwrap_or_else(|| panic!("no {architecture} image in {}", archive.display()));
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
        let emulator =
            (architecture != capture_oci::oci_architecture()).then(|| emulator(architecture));
        (Self { dir, emulator }, image)
    }

    /// Runs `argv` with the image's root as `/`, in `netns` if given.
    fn run(&self, netns: Option<&NetnsGuard>, argv: &[&str], stdin: &str) -> Output {
        let program = self.emulator.unwrap_or("chroot");
        let mut cmd = match netns {
            Some(ns) => in_netns(&ns.path(), program),
            None => Command::new(program),
        };
        match self.emulator {
            // The program by its path in the root (its argv[0], which multi-call binaries read),
            // every absolute path it opens looked up in the root first.
            Some(_) => cmd
                .arg("-L")
                .arg(&self.dir)
                .arg(self.dir.join(argv[0].trim_start_matches('/')))
                .args(&argv[1..]),
            None => cmd.arg(&self.dir).args(argv),
        };
        cmd.env_clear()
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
    the_plugin_and_ip_answer(&root);
    assert!(root
        .run_ok(None, &["/usr/bin/nsenter", "--version"], "")
        .contains("util-linux"));
}

/// capture-cni and ip start from `root` and say what they are.
fn the_plugin_and_ip_answer(root: &Root) {
    // Without CNI_COMMAND the plugin says what it is (on stderr), as the reference plugins do.
    let out = root.run(None, &["/usr/local/bin/capture-cni"], "");
    let about = String::from_utf8_lossy(&out.stderr);
    assert!(about.contains("CNI protocol versions supported"), "{about}");
    assert!(root
        .run_ok(None, &["/usr/bin/ip", "-V"], "")
        .contains("iproute2"));
}

#[test]
fn both_iptables_variants_write_and_read_back_the_sidecar_rules_in_a_pod_netns() {
    let (root, _) = Root::unpack();
    for variant in ["nft", "legacy"] {
        sidecar_rules_round_trip(&root, variant);
    }
}

/// The other platform's image (arm64 on an amd64 machine): every ELF file of its layer holds
/// that architecture's instructions, and its programs run from its own root under emulation:
/// capture says this build's version and carries the same kernel programs, the plugin answers,
/// ip and nsenter start and ip talks to the kernel in a pod netns, iptables-legacy loads the
/// match and target extensions the sidecar's rules use. nft and the nft variant of iptables get
/// past the loader to their own start, where they stop: qemu's user-mode emulation has no
/// `NETLINK_NETFILTER`, so their rules are checked on a real arm64 kernel only (the VM matrix).
#[test]
fn the_other_platforms_image_holds_its_architectures_binaries_and_they_run() {
    let (native, _) = Root::unpack();
    let here = capture_oci::oci_architecture();
    let other = if here == "arm64" { "amd64" } else { "arm64" };
    let (root, image) = Root::unpack_architecture(other);
    let machine = if other == "arm64" { 183 } else { 62 };
    let mut elf_files = 0;
    for layer in &image.layers {
        let mut tar = tar::Archive::new(&layer[..]);
        for entry in tar.entries().expect("the layer's entries") {
            let mut entry = entry.expect("an entry");
            let path = entry.path().expect("a path").display().to_string();
            let mut head = [0_u8; 20];
            if entry.header().entry_type().is_file()
                && std::io::Read::read_exact(&mut entry, &mut head).is_ok()
                && head.starts_with(b"\x7fELF")
            {
                elf_files += 1;
                assert_eq!(
                    u16::from_le_bytes([head[18], head[19]]),
                    machine,
                    "{path} of the {other} image"
                );
            }
        }
    }
    assert!(elf_files > 20, "{elf_files} ELF files in the {other} image");
    let said = |root: &Root| -> serde_json::Value {
        serde_json::from_str(&root.run_ok(
            None,
            &["/usr/local/bin/capture", "version", "--json"],
            "",
        ))
        .expect("capture version --json")
    };
    let (ours, theirs) = (said(&native), said(&root));
    assert_eq!(theirs["version"], ours["version"]);
    assert_eq!(theirs["commit"], ours["commit"]);
    // The same kernel programs, built once: the bytecode does not depend on the architecture.
    assert_eq!(theirs["programs"], ours["programs"]);
    the_plugin_and_ip_answer(&root);
    let pod = NetnsGuard::new("image-other");
    assert!(root
        .run_ok(Some(&pod), &["/usr/bin/ip", "link", "show", "lo"], "")
        .contains("LOOPBACK"));
    assert!(root
        .run_ok(None, &["/usr/bin/nsenter", "--version"], "")
        .contains("util-linux"));
    assert!(root
        .run_ok(None, &["/usr/sbin/iptables-legacy", "--version"], "")
        .contains("legacy"));
    for (kind, extension) in [
        ("-m", "owner"),
        ("-m", "tcp"),
        ("-m", "mark"),
        ("-j", "REDIRECT"),
        ("-j", "TPROXY"),
        ("-j", "MARK"),
        ("-j", "CONNMARK"),
    ] {
        let help = root.run_ok(
            None,
            &["/usr/sbin/iptables-legacy", kind, extension, "-h"],
            "",
        );
        let what = if kind == "-m" { "match" } else { "target" };
        assert!(
            help.contains(&format!("{extension} {what} options")),
            "the {other} image's {extension} extension: {help}"
        );
    }
    for program in [
        ["/usr/sbin/nft", "--version"],
        ["/usr/sbin/iptables-nft", "--version"],
    ] {
        let out = root.run(None, &program, "");
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            out.status.success()
                || said.contains("Netlink")
                || said.contains("Failed to initialize nft"),
            "{program:?} in the {other} image did not reach its own start: {said}"
        );
        assert!(!said.contains("error while loading"), "{program:?}: {said}");
    }
}

/// Writes the sidecar's rules with the image's `iptables-<variant>-restore` in a fresh pod netns
/// and reads them back with its save.
fn sidecar_rules_round_trip(root: &Root, variant: &str) {
    let rules = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../capture-user/src/iptables/testdata/rules-default-sidecar.v4.txt"),
    )
    .expect("the sidecar rules fixture");
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
