//! Builds the kernel programs (capture-ebpf, nightly, bpfel-unknown-none) and leaves the objects in
//! `OUT_DIR` for `include_bytes!`. `CAPTURE_SKIP_EBPF_BUILD=1` writes an empty object instead, so that
//! `cargo check`/clippy work on a machine without bpf-linker; such a binary refuses to load.

use std::{
    env, fs,
    path::{Path, PathBuf},
    process::Command,
};

fn main() {
    let manifest_dir =
        PathBuf::from(env::var_os("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR"));
    let out_dir = PathBuf::from(env::var_os("OUT_DIR").expect("OUT_DIR"));
    let object = out_dir.join("capture.bpf.o");
    let netns_cookie_object = out_dir.join("netns-cookie.bpf.o");
    let adopt_object = out_dir.join("adopt-listeners.bpf.o");
    let workspace = manifest_dir.parent().expect("workspace root");
    for dir in ["capture-ebpf/src", "capture-common/src"] {
        println!("cargo:rerun-if-changed={}", workspace.join(dir).display());
    }
    for file in [
        "capture-ebpf/Cargo.toml",
        "capture-ebpf/build.rs",
        "capture-common/Cargo.toml",
    ] {
        println!("cargo:rerun-if-changed={}", workspace.join(file).display());
    }
    println!("cargo:rerun-if-env-changed=CAPTURE_SKIP_EBPF_BUILD");
    println!("cargo:rerun-if-env-changed={SHARED_EBPF_TARGET}");

    if env::var_os("CAPTURE_SKIP_EBPF_BUILD").is_some_and(|v| v == "1") {
        println!("cargo:warning=CAPTURE_SKIP_EBPF_BUILD=1: the binary carries no kernel programs");
        fs::write(&object, []).expect("write empty object");
        fs::write(&netns_cookie_object, []).expect("write empty object");
        fs::write(&adopt_object, []).expect("write empty object");
    } else {
        let target_dir =
            env::var_os(SHARED_EBPF_TARGET).map_or_else(|| out_dir.join("ebpf-target"), Into::into);
        build_ebpf(
            &workspace.join("capture-ebpf"),
            &target_dir,
            env::var_os("CARGO_FEATURE_LAYOUT_NEXT").is_some(),
            [
                ("capture", &object),
                ("netns-cookie", &netns_cookie_object),
                ("adopt-listeners", &adopt_object),
            ],
        );
    }
    let built = fs::read(&object).expect("read the kernel object");
    println!("cargo:rustc-env=CAPTURE_OBJECT_ID={:016x}", fnv1a(&built));
}

/// FNV-1a: stable across runs and builds, and needs no dependency (loader.rs's `object_id`).
fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Where the kernel build may go instead of this build's `OUT_DIR`: one directory that every
/// configuration of capture-user (clippy's, the tests', the layout variant's) builds the BPF
/// target's `core` in once, rather than once each (`cargo xtask` sets it; the nightly cargo's
/// own lock keeps two builds from writing it at once).
const SHARED_EBPF_TARGET: &str = "CAPTURE_EBPF_TARGET_DIR";

fn build_ebpf(crate_dir: &Path, target_dir: &Path, layout_next: bool, objects: [(&str, &Path); 3]) {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "build", "--release", "--bins"])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(crate_dir);
    if layout_next {
        cmd.args(["--features", "capture-common/layout-next"]);
    }
    // Held from the build to the copy: in a shared directory, another configuration's build
    // would otherwise replace the object in between.
    fs::create_dir_all(target_dir).expect("create the kernel build's target directory");
    let lock = fs::File::create(target_dir.join("capture-build.lock"))
        .expect("create the kernel build's lock file");
    lock.lock()
        .expect("lock the kernel build's target directory");
    // The outer cargo's toolchain and flags must not leak into the nightly BPF build.
    for key in [
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTC_WORKSPACE_WRAPPER",
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_BUILD_TARGET",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(key);
    }
    let status = cmd.status().unwrap_or_else(|e| {
        panic!("cannot run `rustup run nightly cargo` ({e}); run `cargo xtask setup` first")
    });
    assert!(
        status.success(),
        "building capture-ebpf failed ({status}); `cargo xtask setup` installs rust-src and bpf-linker"
    );
    for (bin, object) in objects {
        let built = target_dir.join("bpfel-unknown-none/release").join(bin);
        fs::copy(&built, object)
            .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", built.display(), object.display()));
    }
}
