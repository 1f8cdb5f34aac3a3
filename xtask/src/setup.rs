//! `cargo xtask setup`: the nightly's rust-src, bpf-linker 0.13 linked against the nightly's own
//! libLLVM, and the Debian packages the tests use. Each step checks first and does nothing when
//! its piece is already there.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::run;

/// Debian packages the tests and the demo call: `ip`, `bpftool`, iptables for the iptables
/// backend and its parity tests, and the reference CNI plugins (bridge, host-local) that the CNI
/// end-to-end tests chain capture-cni after.
const PACKAGES: [&str; 4] = [
    "iproute2",
    "bpftool",
    "iptables",
    "containernetworking-plugins",
];
/// Debian packages `cargo xtask vm` needs on the host: qemu to boot the kernels (TCG), kmod for
/// `depmod`/`modprobe` against an unpacked kernel tree, a static busybox for the initramfs (it must
/// run before any library is reachable), and xz to unpack the `.ko.xz` modules of newer kernels.
pub const VM_PACKAGES: [&str; 4] = ["qemu-system-x86", "kmod", "busybox-static", "xz-utils"];
const BPF_LINKER_VERSION: &str = "0.13.0";
/// Where the nightly's libLLVM is linked for bpf-linker (its runpath points here).
const LLVM_PREFIX: &str = "/opt/capture-llvm";

fn quiet_ok(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// Runs a command and returns its trimmed stdout, failing with its stderr.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

fn nightly() -> Result<()> {
    if !quiet_ok(Command::new("rustup").args(["run", "nightly", "rustc", "--version"])) {
        println!("setup: installing the nightly toolchain");
        run(Command::new("rustup").args([
            "toolchain",
            "install",
            "nightly",
            "--profile",
            "minimal",
            "-c",
            "rust-src",
        ]))?;
    }
    let sysroot = PathBuf::from(output(
        Command::new("rustc").args(["+nightly", "--print", "sysroot"]),
    )?);
    if !sysroot.join("lib/rustlib/src/rust/library/core").exists() {
        println!("setup: adding rust-src to nightly");
        run(Command::new("rustup").args([
            "component",
            "add",
            "rust-src",
            "--toolchain",
            "nightly",
        ]))?;
    }
    Ok(())
}

fn bpf_linker() -> Result<()> {
    let version = output(Command::new("bpf-linker").arg("--version")).unwrap_or_default();
    if version.ends_with(BPF_LINKER_VERSION) {
        return Ok(());
    }
    println!("setup: building bpf-linker {BPF_LINKER_VERSION} against the nightly's libLLVM (about a minute)");
    let sysroot = PathBuf::from(output(
        Command::new("rustc").args(["+nightly", "--print", "sysroot"]),
    )?);
    let lib = std::fs::read_dir(sysroot.join("lib"))?
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("libLLVM.so."))
        })
        .context("the nightly toolchain ships no libLLVM.so; bpf-linker cannot be built")?;
    let major = lib
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.strip_prefix("libLLVM.so."))
        .and_then(|v| v.split('.').next())
        .context("cannot read the LLVM version from the library name")?
        .to_string();
    let prefix_lib = Path::new(LLVM_PREFIX).join("lib");
    std::fs::create_dir_all(&prefix_lib)?;
    for name in [
        PathBuf::from("libLLVM.so"),
        PathBuf::from(lib.file_name().unwrap()),
    ] {
        let link = prefix_lib.join(name);
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(&lib, &link)?;
    }
    run(Command::new("cargo")
        .args([
            "install",
            "bpf-linker",
            "--version",
            BPF_LINKER_VERSION,
            "--locked",
            "--no-default-features",
        ])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", LLVM_PREFIX))
}

/// Installs those of `packages` that dpkg does not list as installed.
pub fn debian_packages(packages: &[&str]) -> Result<()> {
    let missing: Vec<&str> = packages
        .iter()
        .copied()
        .filter(|p| {
            output(Command::new("dpkg-query").args(["-W", "-f=${Status}", p]))
                .map_or(true, |s| !s.ends_with("installed"))
        })
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    println!("setup: installing Debian packages {}", missing.join(" "));
    run(Command::new("apt-get").args(["update", "-q"]))?;
    run(Command::new("apt-get")
        .args(["install", "-y", "-q", "--no-install-recommends"])
        .args(&missing)
        .env("DEBIAN_FRONTEND", "noninteractive"))
}

/// kubernetes-validate (PyPI) checks deploy/ against the Kubernetes API schemas offline.
fn python_tools() -> Result<()> {
    if quiet_ok(Command::new("python3").args(["-m", "kubernetes_validate", "--version"])) {
        return Ok(());
    }
    println!("setup: installing kubernetes-validate");
    run(Command::new("python3").args([
        "-m",
        "pip",
        "install",
        "--quiet",
        "--root-user-action=ignore",
        "kubernetes-validate",
    ]))
}

pub fn setup() -> Result<()> {
    nightly()?;
    bpf_linker()?;
    debian_packages(&PACKAGES)?;
    python_tools()
}
