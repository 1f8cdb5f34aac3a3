//! What a kernel's run is made of: the test binaries run, and the results read back from the
//! console. Plain data shared by the parser, the skip rules, the report and the runner.

use std::path::PathBuf;

use serde::Serialize;

/// An integration-test binary of capture-tests and the tests it holds (after the filter).
pub struct TestBinary {
    /// Its target name, e.g. `outbound`.
    pub name: String,
    pub path: PathBuf,
    pub tests: Vec<String>,
}

#[derive(Serialize, Clone, Copy, PartialEq, Eq, Debug)]
#[serde(rename_all = "lowercase")]
pub enum Outcome {
    Pass,
    Fail,
    Skip,
    Ignored,
}

#[derive(Serialize, Clone, Debug)]
pub struct TestResult {
    pub binary: String,
    pub name: String,
    pub outcome: Outcome,
    pub reason: Option<String>,
}

#[derive(Serialize, Debug)]
pub struct BinaryRun {
    pub name: String,
    /// Its exit code, if stage 2 saw it end.
    pub rc: Option<i32>,
    pub seconds: Option<f64>,
}

#[derive(Serialize, Debug)]
pub struct KernelResult {
    pub kernel: String,
    /// `uname -r` as the kernel printed it.
    pub release: Option<String>,
    /// Whether stage 2 started.
    pub booted: bool,
    pub timed_out: bool,
    /// Wall-clock seconds from boot (or the first binary) to the end, set-up excluded.
    pub seconds: f64,
    pub boot_seconds: Option<f64>,
    pub log: String,
    /// Why the kernel as a whole failed (no boot, timeout, unfinished stage 2, set-up error).
    pub error: Option<String>,
    /// Other `capture-vm:` lines (set-up trouble), xtask's notes, kernel panics and oopses.
    pub notes: Vec<String>,
    pub binaries: Vec<BinaryRun>,
    pub tests: Vec<TestResult>,
}

impl KernelResult {
    pub fn count(&self, outcome: Outcome) -> usize {
        self.tests.iter().filter(|t| t.outcome == outcome).count()
    }

    /// `N passed, N failed, N skipped, N ignored in N s`.
    pub fn totals(&self) -> String {
        format!(
            "{} passed, {} failed, {} skipped, {} ignored in {:.0} s",
            self.count(Outcome::Pass),
            self.count(Outcome::Fail),
            self.count(Outcome::Skip),
            self.count(Outcome::Ignored),
            self.seconds
        )
    }

    pub fn failed(&self) -> bool {
        self.error.is_some() || self.count(Outcome::Fail) > 0
    }
}
