//! The suite's test binaries: capture-tests' tier binaries built, and their tests listed by
//! subject with the filter and the scope applied.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use anyhow::{bail, Context as _, Result};

use super::{model::TestBinary, tier, workspace_root, Scope};

/// Builds capture-tests' integration tests and lists their tests (with the filter and the scope
/// applied). `cargo build --bins` must have run: the tests start capture and capture-cni from there.
pub fn test_binaries(only: &[String], filter: &[String], scope: Scope) -> Result<Vec<TestBinary>> {
    // The whole workspace's test build, as `cargo xtask test` runs it: `-p capture-tests` alone
    // would unify other features (capture-user's dev-dependencies') and compile it all again.
    let found = tier_executables(&mut crate::cargo())?;
    let mut binaries = Vec::new();
    let mut subjects = Vec::new();
    for (tier, path) in found {
        let listed = crate::output(Command::new(&path).arg("--list").args(filter))?;
        let mut by_subject: Vec<TestBinary> = Vec::new();
        for test in listed.lines().filter_map(|l| l.strip_suffix(": test")) {
            // A tier of one subject (chaos) keeps its tests at the top: the tier is the subject.
            let (subject, name) = test.split_once("::").unwrap_or((tier.as_str(), test));
            subjects.push(subject.to_string());
            if (!only.is_empty() && !only.iter().any(|o| o == subject)) || !scope.includes(&tier) {
                continue;
            }
            match by_subject.iter_mut().find(|b| b.name == subject) {
                Some(binary) => binary.tests.push(name.to_string()),
                None => by_subject.push(TestBinary {
                    name: subject.to_string(),
                    tier: tier.clone(),
                    path: path.clone(),
                    tests: vec![name.to_string()],
                }),
            }
        }
        binaries.extend(by_subject);
    }
    if let Some(unknown) = only.iter().find(|o| !subjects.contains(o)) {
        subjects.sort();
        subjects.dedup();
        bail!(
            "no subject {unknown} (with this filter): there are {}",
            subjects.join(",")
        );
    }
    if binaries.is_empty() {
        bail!("no test matches the --tests and --filter given");
    }
    // `--tests` also orders the run.
    binaries.sort_by_key(|b| only.iter().position(|n| *n == b.name));
    Ok(binaries)
}

/// Builds capture-tests' tier binaries with `cargo` (`cargo test --no-run` is added, with the
/// test features) and names each tier's executable.
pub fn tier_executables(cargo: &mut Command) -> Result<Vec<(String, PathBuf)>> {
    let tests_dir = workspace_root().join("tests");
    let out = cargo
        .args(["test", "--no-run", "--locked", "--message-format=json"])
        .args(crate::TEST_FEATURES)
        .stderr(Stdio::inherit())
        .output()
        .context("running cargo test --no-run")?;
    let mut found: Vec<(String, PathBuf)> = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else {
            continue;
        };
        // With JSON output, the compiler's errors and warnings come on stdout, inside messages.
        if let Some(rendered) = msg["message"]["rendered"].as_str() {
            eprint!("{rendered}");
        }
        let is_test = msg["reason"] == "compiler-artifact"
            && msg["manifest_path"]
                .as_str()
                .is_some_and(|m| Path::new(m).parent() == Some(&tests_dir))
            && msg["profile"]["test"] == true
            && msg["target"]["kind"]
                .as_array()
                .is_some_and(|kinds| kinds.iter().any(|k| k == "test"));
        if let (true, Some(name), Some(exe)) = (
            is_test,
            msg["target"]["name"].as_str(),
            msg["executable"].as_str(),
        ) {
            found.push((name.to_string(), PathBuf::from(exe)));
        }
    }
    if !out.status.success() {
        bail!("building the test binaries failed ({})", out.status);
    }
    found.sort();
    for name in tier::ALL {
        if !found.iter().any(|(n, _)| n == name) {
            let names: Vec<&str> = found.iter().map(|(n, _)| n.as_str()).collect();
            bail!(
                "no test binary for the tier {name}: there are {}",
                names.join(",")
            );
        }
    }
    Ok(found)
}
