//! Builds the kernel programs (capture-ebpf, nightly, bpfel-unknown-none) and leaves the objects in
//! OUT_DIR for `include_bytes!`. `CAPTURE_SKIP_EBPF_BUILD=1` writes an empty object instead, so that
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
    // The kernel build reads it too (capture-common's layouts), through the inherited environment.
    println!("cargo:rerun-if-env-changed=CAPTURE_LAYOUT_VARIANT");
    println!("cargo:rustc-check-cfg=cfg(capture_layout_next)");
    if env::var_os("CAPTURE_LAYOUT_VARIANT").is_some_and(|v| v == "next") {
        println!("cargo:rustc-cfg=capture_layout_next");
    }

    if env::var_os("CAPTURE_SKIP_EBPF_BUILD").is_some_and(|v| v == "1") {
        println!("cargo:warning=CAPTURE_SKIP_EBPF_BUILD=1: the binary carries no kernel programs");
        fs::write(&object, []).expect("write empty object");
        fs::write(&netns_cookie_object, []).expect("write empty object");
    } else {
        build_ebpf(
            &workspace.join("capture-ebpf"),
            &out_dir.join("ebpf-target"),
            &object,
            &netns_cookie_object,
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

fn build_ebpf(crate_dir: &Path, target_dir: &Path, object: &Path, netns_cookie_object: &Path) {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "build", "--release", "--bins"])
        .arg("--target-dir")
        .arg(target_dir)
        .current_dir(crate_dir);
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
    for (bin, object) in [("capture", object), ("netns-cookie", netns_cookie_object)] {
        let built = target_dir.join("bpfel-unknown-none/release").join(bin);
        fs::copy(&built, object)
            .unwrap_or_else(|e| panic!("copy {} -> {}: {e}", built.display(), object.display()));
    }
}
