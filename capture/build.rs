//! What the binary says it is built from (`capture version`, `--version`, the agent's
//! `capture_build_info`): the version (`<package version>` for a build of the commit tagged
//! `v<package version>`, else `<package version>-dev.<commit>`, which no release can carry), the
//! commit, the target and the compiler. Only inputs of the build: two builds of one commit say the
//! same, so the image stays reproducible.

use std::{env, path::Path, process::Command};

include!("src/version_rule.rs");

fn main() {
    // A commit or a tag changes what the version says (git names where each lives, in a
    // worktree too).
    let branch = run("git", &["symbolic-ref", "-q", "HEAD"]);
    for watched in ["HEAD", "packed-refs", "refs/tags"]
        .into_iter()
        .chain(branch.as_deref())
    {
        if let Some(path) = run("git", &["rev-parse", "--git-path", watched]) {
            println!("cargo:rerun-if-changed={}", Path::new(&path).display());
        }
    }
    let package = env::var("CARGO_PKG_VERSION").expect("CARGO_PKG_VERSION");
    let commit = run("git", &["rev-parse", "HEAD"]).unwrap_or_else(|| "unknown".into());
    let tags = run("git", &["tag", "--points-at", "HEAD"]);
    let version = version_of(&package, &commit, tags.as_deref());
    let rustc = env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let rustc = run(&rustc, &["--version"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rerun-if-changed=src/version_rule.rs");
    println!("cargo:rustc-env=CAPTURE_VERSION={version}");
    println!("cargo:rustc-env=CAPTURE_COMMIT={commit}");
    println!(
        "cargo:rustc-env=CAPTURE_TARGET={}",
        env::var("TARGET").expect("TARGET")
    );
    println!("cargo:rustc-env=CAPTURE_RUSTC={rustc}");
}

/// A command's trimmed output, or None where it fails (a source tree without git).
fn run(program: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(program).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}
