//! `cargo xtask setup`: the nightly's rust-src, bpf-linker 0.13 linked against the nightly's own
//! libLLVM, cargo-fuzz, the Debian packages of every command the tasks and tests run,
//! kubernetes-validate, and bpffs at /sys/fs/bpf where the machine booted without it.
//! Each step checks first and does nothing when its piece is already there; what setup cannot
//! install (rustup, python3 with pip, dpkg and apt) is checked before anything else starts.

pub mod apt_sources;
pub mod check;
mod dpkg;
pub mod private_apt;
mod services;
pub mod tools;

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use crate::{output, run};
use tools::Tool;

const BPF_LINKER_VERSION: &str = "0.13.0";
/// The newest cargo-fuzz, which builds on the stable toolchain here (it runs the fuzz build itself
/// on nightly).
const CARGO_FUZZ_VERSION: &str = "0.13.2";
const CARGO_AUDITABLE_VERSION: &str = "0.7.7";
const CARGO_DENY_VERSION: &str = "0.20.2";
/// Where the nightly's libLLVM is linked for bpf-linker (its runpath points here).
const LLVM_PREFIX: &str = "/opt/capture-llvm";

fn quiet_ok(cmd: &mut Command) -> bool {
    cmd.stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
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
    println!("setup: building bpf-linker {BPF_LINKER_VERSION} against the nightly's libLLVM (about 20 s)");
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
            // Unoptimized: LLVM does the linking, and bpf-linker's own code is a thin layer over
            // it (a kernel build links in the same time); it builds in half the time (18 s
            // against 38 s).
            "--debug",
            "--no-default-features",
        ])
        .args(["--features", &format!("llvm-{major}")])
        .env("LLVM_PREFIX", LLVM_PREFIX))
}

fn cargo_fuzz() -> Result<()> {
    let version = output(Command::new("cargo").args(["fuzz", "--version"])).unwrap_or_default();
    if version.ends_with(CARGO_FUZZ_VERSION) {
        return Ok(());
    }
    println!("setup: installing cargo-fuzz {CARGO_FUZZ_VERSION} (about 15 s)");
    run(Command::new("cargo").args([
        "install",
        "cargo-fuzz",
        "--version",
        CARGO_FUZZ_VERSION,
        "--locked",
        // Unoptimized: it only drives cargo (15 s to build, against 25 s optimized).
        "--debug",
    ]))
}

/// cargo-auditable, which the image's static binaries are built with (their dependency list in
/// a `.dep-v0` section, which scanners and the release's SBOM read), and cargo-deny, which lint
/// checks the dependency graph's licences and sources with (deny.toml).
fn cargo_plugins() -> Result<()> {
    // cargo-auditable has no version of its own to print (it hands every argument to cargo), so
    // cargo's list of what it installed decides.
    let installed = output(Command::new("cargo").args(["install", "--list"])).unwrap_or_default();
    for (package, version, took) in [
        ("cargo-auditable", CARGO_AUDITABLE_VERSION, "about 30 s"),
        ("cargo-deny", CARGO_DENY_VERSION, "about 2 minutes"),
    ] {
        if installed.contains(&format!("{package} v{version}:")) {
            continue;
        }
        println!("setup: installing {package} {version} ({took})");
        run(Command::new("cargo").args([
            "install",
            package,
            "--version",
            version,
            "--locked",
            // Unoptimized: both only drive cargo and read its metadata.
            "--debug",
        ]))?;
    }
    Ok(())
}

/// What building capture-user needs, and no more (its build.rs builds the kernel programs): the
/// nightly's rust-src and bpf-linker, for `cargo xtask completions` on a packager's machine.
pub fn kernel_build_setup() -> Result<()> {
    nightly()?;
    bpf_linker()
}

/// What `cargo xtask fuzz` needs: the nightly and cargo-fuzz (no Debian package, no bpf-linker:
/// the fuzz build leaves the kernel programs out).
pub fn fuzz_setup() -> Result<()> {
    nightly()?;
    cargo_fuzz()
}

/// Installs the packages of `tools` that dpkg does not list as installed (see dpkg.rs for what
/// counts), keeping off any server that comes with them (see services.rs), then checks that
/// every command is there, naming the package of any that is not.
pub fn install(tools: &[Tool]) -> Result<()> {
    install_packages(&tools::packages(tools))?;
    let absent: Vec<String> = tools
        .iter()
        .filter(|t| tools::find(t.command).is_none())
        .map(|t| format!("{} (from {})", t.command, t.package))
        .collect();
    if !absent.is_empty() {
        bail!(
            "installed, yet not found on PATH ({}): {}; reinstall them with apt-get install \
             --reinstall, or put their directory on PATH",
            std::env::var("PATH").unwrap_or_default(),
            absent.join(", ")
        );
    }
    Ok(())
}

/// Installs the packages of `packages` that dpkg does not list as installed.
fn install_packages(packages: &[&str]) -> Result<()> {
    let missing = dpkg::missing(packages, None)?;
    refuse_conflicts(&missing)?;
    if !missing.is_empty() {
        println!("setup: installing Debian packages {}", missing.join(" "));
        services::keep_off(&missing)?;
        run(Command::new("apt-get").args(["update", "-q"]))?;
        run(Command::new("apt-get")
            .args(["install", "-y", "-q", "--no-install-recommends"])
            .args(&missing)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
    }
    Ok(())
}

/// Packages whose installation apt would resolve by removing another the machine relies on.
const CONFLICTS: &[(&str, &str, &str)] = &[(
    "containerd",
    "containerd.io",
    "Docker's containerd.io is installed, and apt would remove it to install Debian's containerd, \
     which the containerd tests run: run the tests on a machine without Docker's packages, or \
     install Debian's containerd yourself if you mean to replace it",
)];

/// Stops before apt removes a package the machine relies on to make room for one setup wants.
fn refuse_conflicts(missing: &[&str]) -> Result<()> {
    let wanted: Vec<&(&str, &str, &str)> = CONFLICTS
        .iter()
        .filter(|(package, _, _)| missing.contains(package))
        .collect();
    if wanted.is_empty() {
        return Ok(());
    }
    let others: Vec<&str> = wanted.iter().map(|(_, other, _)| *other).collect();
    let statuses = dpkg::statuses(&others, None)?;
    for (_, other, why) in wanted {
        if statuses
            .get(other)
            .and_then(Option::as_deref)
            .is_some_and(dpkg::is_installed)
        {
            bail!("setup: {why}");
        }
    }
    Ok(())
}

/// What setup needs and cannot install itself; one error naming all that is missing.
fn prerequisites() -> Result<()> {
    let mut missing: Vec<String> = tools::PREREQUISITES
        .iter()
        .filter(|(command, _)| tools::find(command).is_none())
        .map(|(command, fix)| format!("{command} is missing: {fix}"))
        .collect();
    if tools::find("python3").is_some()
        && !quiet_ok(Command::new("python3").args(["-m", "pip", "--version"]))
    {
        missing.push(
            "python3 has no pip: install pip for it (Debian: apt-get install python3-pip)"
                .to_string(),
        );
    }
    if !missing.is_empty() {
        bail!("before setup can run:\n  {}", missing.join("\n  "));
    }
    Ok(())
}

/// kubernetes-validate (PyPI) checks deploy/ against the Kubernetes API schemas offline.
pub fn python_tools() -> Result<()> {
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

/// Everything `build`, `test`, `demo`, `bench`, `lint` and `fuzz` need.
pub fn setup() -> Result<()> {
    rust_tools()?;
    install(tools::TEST_TOOLS)?;
    image_platforms()?;
    python_tools()?;
    node_bpffs()
}

/// `BPF_FS_MAGIC` from `linux/magic.h`.
const BPF_FS_MAGIC: i64 = 0xcafe_4a11;
const NODE_BPFFS: &str = "/sys/fs/bpf";

/// bpffs at /sys/fs/bpf, where the demo and the tests pin: systemd mounts it at boot, but a
/// machine booted without it (a microVM, a container host's init) may not have it. capture mounts
/// it itself only where it can tell that it runs in the node's mount namespace (PID 1's), which
/// such a machine may hide: the agent then refuses, and every test of it waits for a readiness
/// that does not come.
fn node_bpffs() -> Result<()> {
    let path = std::ffi::CString::new(NODE_BPFFS).expect("no NUL");
    let mut stat = std::mem::MaybeUninit::<libc::statfs>::uninit();
    // SAFETY: a NUL-terminated path and a buffer of the size statfs writes.
    let mounted = unsafe { libc::statfs(path.as_ptr(), stat.as_mut_ptr()) } == 0 && {
        // SAFETY: statfs succeeded, so it filled the buffer.
        let f_type: i64 = unsafe { stat.assume_init() }.f_type;
        f_type == BPF_FS_MAGIC
    };
    if mounted {
        return Ok(());
    }
    println!("setup: mounting bpffs at {NODE_BPFFS}");
    run(Command::new("mount").args(["-t", "bpf", "bpf", NODE_BPFFS]))
}

/// Debian's C cross compilers for the image's other platforms (their static binaries link with
/// them).
pub fn cross_compilers() -> Vec<Tool> {
    crate::image::arch::Arch::foreign()
        .map(|arch| Tool {
            command: arch.gcc,
            package: arch.gcc_package,
        })
        .collect()
}

/// What the image's other platforms (arm64 on an amd64 machine) need: the Rust target and
/// Debian's cross compiler for their static binaries, and their Debian packages of the tools the
/// agent runs, fetched and unpacked under target/debian (image/sources.rs).
pub fn image_platforms() -> Result<()> {
    let installed = output(Command::new("rustup").args(["target", "list", "--installed"]))?;
    for arch in crate::image::arch::Arch::foreign() {
        if !installed.lines().any(|t| t.trim() == arch.rust_target) {
            println!("setup: adding the Rust target {}", arch.rust_target);
            run(Command::new("rustup").args(["target", "add", arch.rust_target]))?;
        }
    }
    install(&cross_compilers())?;
    // The cross compiler's C library (crt1.o, libc.a): a recommendation of the compiler's
    // package, which `--no-install-recommends` leaves out, and the static link needs.
    let libcs: Vec<&str> = crate::image::arch::Arch::foreign()
        .map(|arch| arch.libc_dev_package)
        .collect();
    install_packages(&libcs)?;
    for arch in crate::image::arch::Arch::foreign() {
        crate::image::sources::PackageRoot::prepare(arch, &crate::image::sources::IMAGE_PACKAGES)?;
    }
    Ok(())
}

/// What setup cannot install checked, then the Rust pieces: the nightly's rust-src, bpf-linker
/// and cargo-fuzz (CPU-bound builds, which CI runs while apt works beside them).
pub fn rust_tools() -> Result<()> {
    prerequisites()?;
    nightly()?;
    bpf_linker()?;
    cargo_fuzz()?;
    cargo_plugins()
}
