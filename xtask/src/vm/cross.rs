//! The suite for another architecture's guests: the tier binaries, and the binaries they start
//! (capture, capture-cni, capture-probe, found beside them), cross-built with Debian's cross
//! compiler as the linker. They link dynamically against that architecture's C library, which
//! the guest's root (`guest_root.rs`) holds, of the same Debian release as the cross compiler's.
//!
//! An emulated guest runs what the kernel answers (the tiers verifier and hooks): the other tiers
//! ask the kernel nothing more (scope `kernel` adds only the agent's bookkeeping), and under a
//! second level of emulation they would cost hours.

use std::{path::PathBuf, process::Command};

use anyhow::{Context as _, Result};

use super::{model::TestBinary, Scope};
use crate::{cargo, image::arch::Arch, run, TEST_FEATURES};

/// The widest scope an emulated guest of another architecture runs.
pub const WIDEST: Scope = Scope::Hooks;

/// `binaries` (this machine's, listed) for `arch`: those of `WIDEST`'s tiers, with their paths
/// replaced by the cross-built executables of their tiers.
pub fn test_binaries(arch: Arch, binaries: &[TestBinary]) -> Result<Vec<TestBinary>> {
    let context = || {
        format!(
            "building the test binaries for {}: run cargo xtask setup (it adds the Rust target {} \
             and Debian's cross compiler)",
            arch.oci, arch.rust_target
        )
    };
    run(cross_cargo(arch)
        .args(["build", "--bins", "--locked"])
        .args(TEST_FEATURES))
    .with_context(context)?;
    let executables =
        super::suite::tier_executables(&mut cross_cargo(arch)).with_context(context)?;
    let executable = |tier: &str| -> Result<PathBuf> {
        executables
            .iter()
            .find(|(name, _)| name == tier)
            .map(|(_, path)| path.clone())
            .with_context(|| format!("no {} build of the tier {tier}", arch.oci))
    };
    binaries
        .iter()
        .filter(|b| WIDEST.includes(&b.tier))
        .map(|b| {
            Ok(TestBinary {
                path: executable(&b.tier)?,
                ..b.clone()
            })
        })
        .collect()
}

/// `cargo` building for `arch`, linking with its cross compiler.
fn cross_cargo(arch: Arch) -> Command {
    let mut cmd = cargo();
    arch.link_with_cross_compiler(&mut cmd);
    cmd.env("CARGO_BUILD_TARGET", arch.rust_target);
    cmd
}
