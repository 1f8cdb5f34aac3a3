//! What a kernel's run is made of: the test binaries run, and the results read back from the
//! console. Plain data shared by the parser, the skip rules, the report and the runner.

use std::path::PathBuf;

use serde::Serialize;

/// One subject of the suite: a top-level module of a tier's test binary (`outbound` in `hooks`)
/// and the tests it holds (after the filter), run as a process of its own. The subject, not the
/// tier, is the unit of a kernel's run: shards balance subjects, results and the report name them.
#[derive(Clone)]
pub struct TestBinary {
    /// The module's name, e.g. `outbound` (the tier's name for a tier of one subject).
    pub name: String,
    /// The tier's binary target, e.g. `hooks`.
    pub tier: String,
    pub path: PathBuf,
    /// The tests' names inside the module (`default_sidecar`, `istio::gateway_left_alone`).
    pub tests: Vec<String>,
}

/// libtest flags of the filter that still apply once the tests are named one by one.
const PASSED_THROUGH: &[&str] = &["--ignored", "--include-ignored"];

impl TestBinary {
    /// The arguments that run exactly this subject's tests of the tier's binary, and of `filter`
    /// the flags that still mean something once the names are exact.
    pub fn run_args(&self, filter: &[String]) -> Vec<String> {
        let flags = filter
            .iter()
            .filter(|a| PASSED_THROUGH.contains(&a.as_str()))
            .cloned();
        ["--test-threads=2".to_string(), "--exact".to_string()]
            .into_iter()
            .chain(flags)
            .chain(self.tests.iter().map(|t| self.full_name(t)))
            .collect()
    }

    /// `test` as the harness names it: inside the subject's module, or at the top of a tier
    /// whose only subject it is.
    fn full_name(&self, test: &str) -> String {
        if self.name == self.tier {
            test.to_string()
        } else {
            format!("{}::{test}", self.name)
        }
    }

    /// `name` as the test harness prints it (`outbound::default_sidecar`) without this
    /// subject's prefix.
    pub fn short<'a>(subject: &str, name: &'a str) -> &'a str {
        name.strip_prefix(subject)
            .and_then(|rest| rest.strip_prefix("::"))
            .unwrap_or(name)
    }
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

    /// One kernel's result from the results of its VMs: their binaries and tests in the order of
    /// `binaries`, their errors and notes, their logs, and their seconds added up (the emulated
    /// time the kernel took, whatever ran beside it).
    pub fn merge(parts: Vec<KernelResult>, binaries: &[TestBinary]) -> KernelResult {
        let mut parts = parts.into_iter();
        let mut merged = parts.next().expect("a kernel ran in at least one VM");
        for part in parts {
            merged.release = merged.release.or(part.release);
            merged.booted &= part.booted;
            merged.timed_out |= part.timed_out;
            merged.seconds += part.seconds;
            merged.boot_seconds = match (merged.boot_seconds, part.boot_seconds) {
                (Some(a), Some(b)) => Some(a.max(b)),
                (a, b) => a.or(b),
            };
            merged.log = format!("{}, {}", merged.log, part.log);
            merged.error = match (merged.error.take(), part.error) {
                (Some(a), Some(b)) => Some(format!("{a}; {b}")),
                (a, b) => a.or(b),
            };
            merged.notes.extend(part.notes);
            merged.binaries.extend(part.binaries);
            merged.tests.extend(part.tests);
        }
        let position = |name: &str| binaries.iter().position(|b| b.name == name);
        merged.binaries.sort_by_key(|b| position(&b.name));
        merged.tests.sort_by_key(|t| position(&t.binary));
        merged
    }
}
