//! `cargo xtask fuzz`: builds the fuzz targets of `fuzz/` (cargo-fuzz, nightly, AddressSanitizer)
//! and runs each for a while on a scratch copy of its committed corpus and regressions, so that
//! a run leaves the tree as it was. A crash, a hang (`-timeout`) or an out-of-memory
//! (`-rss_limit_mb`) fails the task, naming the input libFuzzer saved.

use std::{
    fs,
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use serde::Serialize;

use crate::{output, run, workspace};

/// Seconds one input may take before libFuzzer reports a hang.
const INPUT_TIMEOUT_SECS: u64 = 10;
/// The memory a target may use before libFuzzer reports an out-of-memory.
const RSS_LIMIT_MB: u64 = 2048;
/// How long past its time a target may run before it is killed as stuck (libFuzzer's own
/// timeout watches single inputs only).
const GRACE: Duration = Duration::from_mins(2);

pub struct Options {
    pub time: Duration,
    pub targets: Vec<String>,
    pub json: Option<PathBuf>,
    /// Build without optimizations (and with overflow checks): half the build time, fewer
    /// executions per second, which a short smoke that replays the corpus can afford.
    pub dev: bool,
}

/// What one target's run did, from libFuzzer's final stats.
#[derive(Debug, Default, PartialEq, Serialize)]
pub struct TargetRun {
    pub target: String,
    pub execs: u64,
    pub execs_per_sec: u64,
    pub seconds: f64,
    pub corpus_files: usize,
    pub corpus_bytes: u64,
    pub peak_rss_mb: u64,
    /// `None` when the run was clean, else what went wrong and where libFuzzer left the input.
    pub failure: Option<String>,
}

/// `30s`, `5m`, `1h`, or a number of seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let text = text.trim();
    let (number, unit) = match text.find(|c: char| !c.is_ascii_digit()) {
        Some(i) => text.split_at(i),
        None => (text, "s"),
    };
    let n: u64 = number
        .parse()
        .map_err(|_| format!("{text:?} is not a duration such as 30s, 5m or 1h"))?;
    let secs = match unit {
        "s" => n,
        "m" => n * 60,
        "h" => n * 3600,
        _ => return Err(format!("{text:?}: the unit must be s, m or h")),
    };
    if secs == 0 {
        return Err("a fuzz run needs at least one second".into());
    }
    Ok(Duration::from_secs(secs))
}

/// Under the caller's target directory, beside the workspace's own builds: the fuzz build has
/// other flags and a target triple of its own, so it shares nothing with them anyway.
fn fuzz_target_dir() -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map_or_else(|| workspace().join("target"), PathBuf::from)
        .join("fuzz")
}

/// `cargo fuzz` on the nightly, with none of the outer cargo's toolchain settings.
fn cargo_fuzz() -> Command {
    let mut cmd = Command::new("rustup");
    cmd.args(["run", "nightly", "cargo", "fuzz"])
        .current_dir(workspace().join("fuzz"))
        // The kernel programs are not needed, and the sanitizer flags must not reach their build.
        .env("CAPTURE_SKIP_EBPF_BUILD", "1");
    for key in [
        "CARGO",
        "RUSTC",
        "RUSTC_WRAPPER",
        "RUSTUP_TOOLCHAIN",
        "RUSTFLAGS",
        "CARGO_ENCODED_RUSTFLAGS",
        "CARGO_TARGET_DIR",
    ] {
        cmd.env_remove(key);
    }
    cmd
}

/// rustfmt and clippy on the fuzz crate, which the workspace's own lint does not reach.
pub fn lint() -> Result<()> {
    let manifest = workspace().join("fuzz/Cargo.toml");
    run(crate::cargo()
        .arg("fmt")
        .arg("--manifest-path")
        .arg(&manifest)
        .args(["--", "--check"]))?;
    // In the workspace's own target directory, with the kernel programs built as there: the
    // dependencies both check alike are checked once (on a clean clone, after the workspace's
    // lint: 20 s, against 26 s in a directory of its own).
    run(crate::cargo()
        .args(["clippy", "--all-targets", "--locked", "--manifest-path"])
        .arg(&manifest)
        .arg("--target-dir")
        .arg(std::path::absolute(crate::builds::target_dir())?)
        .args(["--", "-D", "warnings"]))
}

pub fn run_fuzz(opts: &Options) -> Result<()> {
    let all: Vec<String> = output(cargo_fuzz().arg("list"))?
        .lines()
        .map(str::to_string)
        .collect();
    let targets = if opts.targets.is_empty() {
        all.clone()
    } else {
        for t in &opts.targets {
            if !all.contains(t) {
                bail!("no fuzz target {t}; there are: {}", all.join(", "));
            }
        }
        opts.targets.clone()
    };
    let target_dir = fuzz_target_dir();
    println!(
        "fuzz: building {} (nightly, AddressSanitizer{})",
        targets.join(", "),
        if opts.dev { ", unoptimized" } else { "" }
    );
    let mut build = cargo_fuzz();
    build.arg("build").arg("--target-dir").arg(&target_dir);
    if opts.dev {
        build.arg("--dev");
    }
    run(&mut build)?;
    let profile = if opts.dev { "debug" } else { "release" };
    let bin_dir = target_dir.join("x86_64-unknown-linux-gnu").join(profile);
    // libFuzzer runs on one core: the targets run side by side, one per core.
    let jobs = std::thread::available_parallelism().map_or(1, std::num::NonZero::get);
    let runs = crate::in_parallel(&targets, jobs, |target| {
        let result = run_target(&bin_dir, target, opts.time)?;
        match &result.failure {
            None => println!(
                "fuzz: {target}: {} execs in {:.0} s ({}/s), corpus {} files",
                result.execs, result.seconds, result.execs_per_sec, result.corpus_files
            ),
            Some(why) => println!("fuzz: {target}: FAILED: {why}"),
        }
        Ok(result)
    })?;
    print_summary(&runs);
    if let Some(path) = &opts.json {
        fs::write(path, serde_json::to_vec_pretty(&runs)?)
            .with_context(|| format!("writing {}", path.display()))?;
    }
    let failed: Vec<&str> = runs
        .iter()
        .filter(|r| r.failure.is_some())
        .map(|r| r.target.as_str())
        .collect();
    if !failed.is_empty() {
        bail!(
            "fuzz targets failed: {} (reproduce with the saved input: `cargo fuzz run TARGET INPUT` in fuzz/, \
             then make it a test in capture-model or capture-cni and keep the input under fuzz/regressions/TARGET/)",
            failed.join(", ")
        );
    }
    Ok(())
}

/// Copies every file of `from` into `to`; a missing `from` has nothing to copy.
fn copy_files(from: &Path, to: &Path) -> Result<()> {
    let Ok(entries) = fs::read_dir(from) else {
        return Ok(());
    };
    for entry in entries {
        let path = entry?.path();
        if path.is_file() {
            fs::copy(&path, to.join(path.file_name().expect("a file name")))?;
        }
    }
    Ok(())
}

fn run_target(bin_dir: &Path, target: &str, time: Duration) -> Result<TargetRun> {
    let fuzz = workspace().join("fuzz");
    let scratch = fuzz_target_dir().join("runs").join(target);
    let _ = fs::remove_dir_all(&scratch);
    let (corpus, artifacts) = (scratch.join("corpus"), scratch.join("artifacts"));
    fs::create_dir_all(&corpus)?;
    fs::create_dir_all(&artifacts)?;
    copy_files(&fuzz.join("corpus").join(target), &corpus)?;
    copy_files(&fuzz.join("regressions").join(target), &corpus)?;
    let log_path = scratch.join("libfuzzer.log");
    let log = fs::File::create(&log_path)?;
    let start = Instant::now();
    let mut child = Command::new(bin_dir.join(target))
        .arg(format!("-max_total_time={}", time.as_secs()))
        .arg(format!("-timeout={INPUT_TIMEOUT_SECS}"))
        .arg(format!("-rss_limit_mb={RSS_LIMIT_MB}"))
        .arg("-print_final_stats=1")
        .arg(format!("-artifact_prefix={}/", artifacts.display()))
        .arg(&corpus)
        .stdout(log.try_clone()?)
        .stderr(log)
        .stdin(Stdio::null())
        .spawn()
        .with_context(|| format!("running the fuzz target {target}"))?;
    let status = loop {
        if let Some(status) = child.try_wait()? {
            break Some(status);
        }
        if start.elapsed() > time + GRACE {
            let _ = child.kill();
            let _ = child.wait();
            break None;
        }
        std::thread::sleep(Duration::from_millis(200));
    };
    let seconds = start.elapsed().as_secs_f64();
    let text = fs::read_to_string(&log_path).unwrap_or_default();
    let mut result = parse_stats(target, &text);
    result.seconds = (seconds * 10.0).round() / 10.0;
    for entry in fs::read_dir(&corpus)? {
        result.corpus_files += 1;
        result.corpus_bytes += entry?.metadata()?.len();
    }
    result.failure = match status {
        None => Some(format!(
            "still running {} s past its time: killed (log: {})",
            GRACE.as_secs(),
            log_path.display()
        )),
        Some(s) if s.success() => None,
        Some(s) => {
            let mut stderr = std::io::stderr();
            for line in report_lines(&text) {
                let _ = writeln!(stderr, "  {target}| {line}");
            }
            Some(format!(
                "{} ({s}); input: {}; log: {}",
                failure_kind(&text),
                saved_input(&text).unwrap_or_else(|| "none saved".into()),
                log_path.display()
            ))
        }
    };
    Ok(result)
}

/// What to show of a failed run's log: the panic or libFuzzer's error with a few lines after it
/// (not the backtrace), and where the input went; the log's end when neither is found.
fn report_lines(text: &str) -> Vec<&str> {
    let lines: Vec<&str> = text.lines().collect();
    let Some(start) = lines
        .iter()
        .position(|l| l.contains("panicked at") || l.contains("ERROR: "))
    else {
        return lines[lines.len().saturating_sub(40)..].to_vec();
    };
    let mut shown: Vec<&str> = lines[start..].iter().take(8).copied().collect();
    if let Some(saved) = lines[start..]
        .iter()
        .skip(8)
        .find(|l| l.contains("Test unit written to"))
    {
        shown.push(saved);
    }
    shown
}

/// libFuzzer's final stats (`-print_final_stats=1`).
fn parse_stats(target: &str, text: &str) -> TargetRun {
    let mut run = TargetRun {
        target: target.into(),
        ..TargetRun::default()
    };
    for line in text.lines() {
        let Some((key, value)) = line.strip_prefix("stat::").and_then(|l| l.split_once(':')) else {
            continue;
        };
        let value: u64 = value.trim().parse().unwrap_or(0);
        match key {
            "number_of_executed_units" => run.execs = value,
            "average_exec_per_sec" => run.execs_per_sec = value,
            "peak_rss_mb" => run.peak_rss_mb = value,
            _ => {}
        }
    }
    run
}

fn failure_kind(text: &str) -> &'static str {
    if text.contains("libFuzzer: timeout") {
        "a hang (an input ran past the timeout)"
    } else if text.contains("libFuzzer: out-of-memory") || text.contains("malloc limit") {
        "out of memory"
    } else if text.contains("panicked at") || text.contains("deadly signal") {
        "a crash"
    } else if text.contains("ERROR: AddressSanitizer") {
        "a memory error (AddressSanitizer)"
    } else {
        "the fuzzer failed"
    }
}

/// Where libFuzzer saved the failing input.
fn saved_input(text: &str) -> Option<String> {
    text.lines()
        .find_map(|l| l.split_once("Test unit written to "))
        .map(|(_, path)| path.trim().to_string())
}

fn print_summary(runs: &[TargetRun]) {
    println!(
        "\n{:<16} {:>12} {:>9} {:>8} {:>14} {:>8}  result",
        "target", "execs", "exec/s", "seconds", "corpus", "rss MB"
    );
    for r in runs {
        println!(
            "{:<16} {:>12} {:>9} {:>8.1} {:>14} {:>8}  {}",
            r.target,
            r.execs,
            r.execs_per_sec,
            r.seconds,
            format!("{} ({} KiB)", r.corpus_files, r.corpus_bytes.div_ceil(1024)),
            r.peak_rss_mb,
            if r.failure.is_some() { "FAILED" } else { "ok" }
        );
    }
    let failed = runs.iter().filter(|r| r.failure.is_some()).count();
    println!("fuzz: {} passed, {failed} failed", runs.len() - failed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn durations() {
        assert_eq!(parse_duration("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_mins(5)));
        assert_eq!(parse_duration("1h"), Ok(Duration::from_hours(1)));
        assert_eq!(parse_duration("45"), Ok(Duration::from_secs(45)));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("m").is_err());
        assert!(parse_duration("").is_err());
    }

    #[test]
    fn final_stats_and_failures() {
        let log = "#2097152\tpulse  cov: 1 ft: 2 corp: 3/4b exec/s: 5 rss: 6Mb\n\
                   Done 2500000 runs in 61 second(s)\n\
                   stat::number_of_executed_units: 2500000\n\
                   stat::average_exec_per_sec:     40983\n\
                   stat::new_units_added:          117\n\
                   stat::slowest_unit_time_sec:    0\n\
                   stat::peak_rss_mb:              412\n";
        let run = parse_stats("record", log);
        assert_eq!(
            (run.execs, run.execs_per_sec, run.peak_rss_mb),
            (2_500_000, 40_983, 412)
        );
        let crash = "thread '<unnamed>' panicked at src/lib.rs:1:1:\n\
                     ==1== ERROR: libFuzzer: deadly signal\n\
                     artifact_prefix='/t/'; Test unit written to /t/crash-abc\n";
        assert_eq!(failure_kind(crash), "a crash");
        assert_eq!(report_lines(crash), crash.lines().collect::<Vec<_>>());
        assert_eq!(saved_input(crash).as_deref(), Some("/t/crash-abc"));
        assert_eq!(
            failure_kind("==1== ERROR: libFuzzer: timeout after 10 seconds"),
            "a hang (an input ran past the timeout)"
        );
        assert_eq!(
            failure_kind("==1== ERROR: libFuzzer: out-of-memory (used: 2100Mb)"),
            "out of memory"
        );
    }
}
