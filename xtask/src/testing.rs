//! `cargo xtask test`: `cargo test` over the whole workspace, its output streamed, with one
//! closing line that totals every test binary; `--repeat N` runs it N times and names every test
//! that did not pass each time (a flake, unless a round changed something).

use std::{
    collections::BTreeMap,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::Stdio,
};

use anyhow::{bail, Context as _, Result};

use crate::{cargo, TEST_FEATURES};

/// A directory of one test run's own, where the tests keep what they learn once per run
/// (`capture_tests::once_per_run`); removed when the run ends.
pub struct TestCache(PathBuf);

impl TestCache {
    pub const VAR: &str = "CAPTURE_TEST_CACHE";

    pub fn new() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!("capture-test-cache-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
        Ok(Self(dir))
    }

    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TestCache {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// How one test ended in one run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Outcome {
    Passed,
    Failed,
    Ignored,
}

/// Every test of one `cargo test` run by `binary test-name`, and whether cargo succeeded.
#[derive(Debug, Default)]
pub struct Run {
    pub outcomes: BTreeMap<String, Outcome>,
    pub succeeded: bool,
}

impl Run {
    fn count(&self, outcome: Outcome) -> usize {
        self.outcomes.values().filter(|o| **o == outcome).count()
    }
}

/// Reads cargo test's output: `Running <binary> (...)` starts a binary, `test NAME ... RESULT`
/// is one of its tests.
#[derive(Default)]
pub struct OutputReader {
    binary: String,
    pub outcomes: BTreeMap<String, Outcome>,
}

impl OutputReader {
    pub fn line(&mut self, line: &str) {
        let line = line.trim();
        if let Some(rest) = line.strip_prefix("Running ") {
            // `Running tests/parity.rs (target/debug/deps/parity-…)`, `Running unittests src/lib.rs (…)`
            let path = rest.rsplit_once(" (").map_or(rest, |(what, _)| what);
            self.binary = path.to_string();
            return;
        }
        let Some(rest) = line.strip_prefix("test ") else {
            return;
        };
        let Some((name, result)) = rest.rsplit_once(" ... ") else {
            return;
        };
        // `ok`, `FAILED`, `ignored` or `ignored, <reason>`.
        let word: String = result
            .chars()
            .take_while(char::is_ascii_alphabetic)
            .collect();
        let outcome = match word.as_str() {
            "ok" => Outcome::Passed,
            "FAILED" => Outcome::Failed,
            "ignored" => Outcome::Ignored,
            _ => return,
        };
        self.outcomes
            .insert(format!("{} {name}", self.binary), outcome);
    }
}

/// One `cargo test` of the workspace with `args`, its output streamed.
pub fn run_once(args: &[String]) -> Result<Run> {
    let cache = TestCache::new()?;
    let mut child = cargo()
        .args(["test", "--locked", "--no-fail-fast"])
        .args(TEST_FEATURES)
        .args(args)
        .env(TestCache::VAR, cache.path())
        .stdout(Stdio::piped())
        .spawn()
        .context("running cargo test")?;
    let mut reader = OutputReader::default();
    for line in BufReader::new(child.stdout.take().expect("piped stdout")).lines() {
        let line = line?;
        println!("{line}");
        reader.line(&line);
    }
    let status = child.wait()?;
    let run = Run {
        outcomes: reader.outcomes,
        succeeded: status.success(),
    };
    println!(
        "tests: {} passed, {} failed, {} skipped",
        run.count(Outcome::Passed),
        run.count(Outcome::Failed),
        run.count(Outcome::Ignored)
    );
    Ok(run)
}

/// `cargo xtask test [--repeat N] [ARGS]`.
pub fn test(args: &[String], repeat: usize) -> Result<()> {
    if repeat <= 1 {
        let run = run_once(args)?;
        if !run.succeeded {
            bail!("cargo test failed");
        }
        return Ok(());
    }
    let mut runs = Vec::new();
    for round in 1..=repeat {
        println!("repeat: round {round} of {repeat}");
        runs.push(run_once(args)?);
    }
    let report = repeat_report(&runs);
    println!("{}", report.text);
    if !report.unsteady.is_empty() || runs.iter().any(|r| !r.succeeded) {
        bail!(
            "{} test(s) did not pass in every one of {repeat} rounds",
            report.unsteady.len()
        );
    }
    Ok(())
}

/// What N runs of the suite say about each test.
pub struct RepeatReport {
    /// The tests that did not pass in every round (missing from a round counts as not passing).
    pub unsteady: Vec<String>,
    pub text: String,
}

pub fn repeat_report(runs: &[Run]) -> RepeatReport {
    let mut all: BTreeMap<&str, Vec<Option<Outcome>>> = BTreeMap::new();
    for run in runs {
        for name in run.outcomes.keys() {
            all.entry(name).or_default();
        }
    }
    for (name, seen) in &mut all {
        *seen = runs
            .iter()
            .map(|r| r.outcomes.get(*name).copied())
            .collect();
    }
    let mut unsteady = Vec::new();
    let mut steady = 0;
    let mut skipped = 0;
    let mut lines = Vec::new();
    for (name, seen) in &all {
        if seen.iter().all(|o| *o == Some(Outcome::Ignored)) {
            skipped += 1;
        } else if seen.iter().all(|o| *o == Some(Outcome::Passed)) {
            steady += 1;
        } else {
            let passed = seen.iter().filter(|o| **o == Some(Outcome::Passed)).count();
            let rounds: Vec<String> = seen
                .iter()
                .map(|o| match o {
                    Some(Outcome::Passed) => "ok",
                    Some(Outcome::Failed) => "FAILED",
                    Some(Outcome::Ignored) => "skipped",
                    None => "not run",
                })
                .map(str::to_string)
                .collect();
            lines.push(format!(
                "  {name}: passed {passed} of {} ({})",
                runs.len(),
                rounds.join(", ")
            ));
            unsteady.push((*name).to_string());
        }
    }
    let mut text = format!(
        "repeat: {} rounds; {steady} tests passed every time, {skipped} skipped every time, {} did not pass every time",
        runs.len(),
        unsteady.len()
    );
    for line in lines {
        text.push('\n');
        text.push_str(&line);
    }
    RepeatReport { unsteady, text }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run_of(lines: &[&str]) -> Run {
        let mut reader = OutputReader::default();
        for line in lines {
            reader.line(line);
        }
        Run {
            outcomes: reader.outcomes,
            succeeded: true,
        }
    }

    #[test]
    fn reads_each_tests_outcome_under_its_binary() {
        let run = run_of(&[
            "     Running tests/parity.rs (target/debug/deps/parity-0123)",
            "test default_sidecar ... ok",
            "test udp ... FAILED",
            "     Running unittests src/lib.rs (target/debug/deps/capture_user-4567)",
            "test config::tests::a ... ignored, needs root",
            "test result: ok. 1 passed; 0 failed",
        ]);
        assert_eq!(
            run.outcomes.get("tests/parity.rs default_sidecar"),
            Some(&Outcome::Passed)
        );
        assert_eq!(
            run.outcomes.get("tests/parity.rs udp"),
            Some(&Outcome::Failed)
        );
        assert_eq!(
            run.outcomes.get("unittests src/lib.rs config::tests::a"),
            Some(&Outcome::Ignored)
        );
        assert_eq!(run.outcomes.len(), 3);
    }

    #[test]
    fn a_test_that_failed_or_went_missing_in_one_round_is_named() {
        let steady = [
            "     Running tests/a.rs (x)",
            "test one ... ok",
            "test two ... ok",
        ];
        let runs = vec![
            run_of(&steady),
            run_of(&[
                "     Running tests/a.rs (x)",
                "test one ... ok",
                "test two ... FAILED",
            ]),
            run_of(&["     Running tests/a.rs (x)", "test one ... ok"]),
        ];
        let report = repeat_report(&runs);
        assert_eq!(report.unsteady, ["tests/a.rs two"]);
        assert!(
            report.text.contains("passed 1 of 3 (ok, FAILED, not run)"),
            "{}",
            report.text
        );
        assert!(repeat_report(&[run_of(&steady), run_of(&steady)])
            .unsteady
            .is_empty());
    }
}
