//! `cargo xtask completions [--out DIR]`: shell completions and man pages for `capture`.
//!
//! The `capture` binary writes them itself (its hidden `generate-docs`, from its own clap
//! definition): this binary cannot link the `capture` crate, whose build (capture-user's) needs the kernel programs'
//! toolchain that `cargo xtask setup` installs after this binary is built.

use std::{path::Path, process::Command};

use anyhow::{Context as _, Result};

use crate::{builds, run};

/// Builds `capture` and has it write its completions and man pages into `out`.
pub fn write(out: &Path) -> Result<()> {
    let capture = builds::build_capture()?;
    std::fs::create_dir_all(out).with_context(|| format!("creating {}", out.display()))?;
    run(Command::new(&capture)
        .arg("generate-docs")
        .arg("--out")
        .arg(out))
}
