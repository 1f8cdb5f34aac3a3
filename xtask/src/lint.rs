//! `cargo xtask lint`: rustfmt, the import-cycle check (cycles.rs), the docs' relative links
//! (doclinks.rs), the dependency policy (deny.rs), and clippy `-D warnings` over the user side (with and without the test-only
//! switches), the fuzz crate and the kernel side.

use std::process::Command;

use anyhow::Result;

use crate::{cargo, fuzz, run, TEST_FEATURES};

pub fn lint() -> Result<()> {
    run(cargo().args(["fmt", "--all", "--", "--check"]))?;
    crate::cycles::check(&crate::workspace())?;
    crate::doclinks::check(&crate::workspace())?;
    crate::layers::check(&crate::workspace())?;
    crate::deny::check()?;
    run(cargo()
        .args(["clippy", "--all-targets", "--locked"])
        .args(TEST_FEATURES)
        .args(["--", "-D", "warnings"]))?;
    run(cargo().args([
        "clippy",
        "--all-targets",
        "--locked",
        "--",
        "-D",
        "warnings",
    ]))?;
    fuzz::lint()?;
    run(Command::new("rustup")
        .args([
            "run",
            "nightly",
            "cargo",
            "clippy",
            "--release",
            "--",
            "-D",
            "warnings",
        ])
        .current_dir("capture-ebpf"))
}
