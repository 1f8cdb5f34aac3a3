//! Reading a kernel's console log into per-test results, writing them as JSON, and the summary.
//!
//! The log holds libtest's `test NAME ... ok|FAILED|ignored` lines (coloured: the serial console
//! is a tty), framed by stage 2's `capture-vm:` lines, with kernel printk lines mixed in — at the
//! start of a line or cutting into one — and `capture-skip:` lines, which features.rs judges.

use std::{fs, path::Path};

use anyhow::Result;

use super::{
    features,
    lines::{after, before_printk, clean, is_panic, outcome_word, test_line, NOTE, SKIP, VM},
    model::{BinaryRun, KernelResult, Outcome, TestBinary, TestResult},
};

/// What the log says of one test.
struct Seen {
    /// `binary::name`.
    key: String,
    outcome: Outcome,
    reason: Option<String>,
    /// Whether `reason` is already the panic message (the first one wins).
    final_reason: bool,
}

/// Reads the log of `kernel` against the tests each binary lists. The caller fills in timing,
/// timeout and log path.
pub fn parse(kernel: &str, text: &str, expected: &[&TestBinary]) -> KernelResult {
    let mut result = KernelResult {
        kernel: kernel.to_string(),
        release: None,
        booted: false,
        timed_out: false,
        seconds: 0.0,
        boot_seconds: None,
        log: String::new(),
        error: None,
        notes: Vec::new(),
        binaries: Vec::new(),
        tests: Vec::new(),
    };
    let mut done = false;
    // [binary, test, feature, reason]: stage 2 prints a binary's skips after its end line.
    let mut skips: Vec<[String; 4]> = Vec::new();
    let mut last_binary = String::new();
    let mut seen: Vec<Seen> = Vec::new();
    let mut current: Option<String> = None;
    let mut pending: Option<String> = None;
    let mut failure_block: Option<String> = None;
    let mut in_failure_list = false;
    for raw in text.lines() {
        let cleaned = clean(raw);
        if ["Kernel panic", "BUG:", "Oops:"]
            .iter()
            .any(|w| cleaned.contains(w))
        {
            result.notes.push(cleaned.trim().to_string());
        }
        let Some(line) = before_printk(&cleaned) else {
            continue;
        };
        if let Some(note) = line.strip_prefix(NOTE) {
            result.notes.push(note.to_string());
        } else if let Some(rest) = after(line, VM) {
            match rest.split_whitespace().collect::<Vec<_>>().as_slice() {
                ["kernel", release] => {
                    result.booted = true;
                    result.release = Some(release.to_string());
                }
                ["begin", name] => {
                    current = Some(name.to_string());
                    last_binary = name.to_string();
                    result.binaries.push(BinaryRun {
                        name: name.to_string(),
                        rc: None,
                        seconds: None,
                    });
                    (pending, failure_block, in_failure_list) = (None, None, false);
                }
                ["end", name, rc] => {
                    if let Some(run) = result.binaries.iter_mut().rev().find(|b| b.name == *name) {
                        run.rc = rc.strip_prefix("rc=").and_then(|n| n.parse().ok());
                    }
                    current = None;
                }
                ["done"] => done = true,
                _ => result.notes.push(rest.to_string()),
            }
        } else if let Some(skip) = after(line, SKIP) {
            let mut parts: Vec<&str> = skip.splitn(3, '\t').collect();
            if parts.len() < 3 {
                parts = skip.splitn(3, char::is_whitespace).collect();
            }
            let part = |i: usize| parts.get(i).map_or("", |p| p.trim()).to_string();
            let test = TestBinary::short(&last_binary, &part(0)).to_string();
            skips.push([last_binary.clone(), test, part(1), part(2)]);
        } else if let Some(binary) = &current {
            let key = |name: &str| format!("{binary}::{}", TestBinary::short(binary, name));
            if let Some((name, outcome)) = test_line(line) {
                match outcome {
                    Some(outcome) => record(&mut seen, key(name), outcome),
                    None => pending = Some(name.to_string()),
                }
            } else if let (Some(name), Some(outcome)) = (&pending, outcome_word(line)) {
                record(&mut seen, key(name), outcome);
                pending = None;
            } else if let Some(name) = line
                .strip_prefix("---- ")
                .and_then(|l| l.split_whitespace().next())
            {
                failure_block = Some(key(name));
            } else if line == "failures:" {
                // The second `failures:` heading (after the output blocks) lists the names.
                in_failure_list |= failure_block.take().is_some();
            } else if in_failure_list && line.starts_with("    ") && !line.trim().contains(' ') {
                record(&mut seen, key(line.trim()), Outcome::Fail);
            } else if let Some(block) = &failure_block {
                if let Some(test) = seen.iter_mut().find(|s| s.key == *block) {
                    take_reason(test, line.trim());
                }
            }
        }
    }
    classify(&mut result, expected, &seen, done);
    features::apply_skips(&mut result, &skips);
    result
}

fn record(seen: &mut Vec<Seen>, key: String, outcome: Outcome) {
    if !seen.iter().any(|s| s.key == key) {
        seen.push(Seen {
            key,
            outcome,
            reason: None,
            final_reason: false,
        });
    }
}

/// Keeps the panic message of a failure's output (the line after `panicked at`), else its first
/// line.
fn take_reason(test: &mut Seen, line: &str) {
    const MAX: usize = 300;
    if test.final_reason || line.is_empty() {
        return;
    }
    let after_panic = test.reason.as_deref().is_some_and(is_panic);
    if after_panic || test.reason.is_none() || is_panic(line) {
        test.reason = Some(line.chars().take(MAX).collect());
        test.final_reason = after_panic;
    }
}

fn classify(result: &mut KernelResult, expected: &[&TestBinary], seen: &[Seen], done: bool) {
    for binary in expected {
        let run = result.binaries.iter().find(|b| b.name == binary.name);
        for name in &binary.tests {
            let key = format!("{}::{name}", binary.name);
            let (outcome, reason) = match (seen.iter().find(|s| s.key == key), run) {
                (Some(s), _) => (s.outcome, s.reason.clone()),
                (None, None) => (Outcome::Fail, Some("did not run".to_string())),
                (None, Some(BinaryRun { rc: None, .. })) => {
                    (Outcome::Fail, Some("did not finish".to_string()))
                }
                (None, Some(BinaryRun { rc: Some(rc), .. })) => (
                    Outcome::Fail,
                    Some(format!("no result on the console (rc={rc})")),
                ),
            };
            result.tests.push(TestResult {
                binary: binary.name.clone(),
                name: name.clone(),
                outcome,
                reason,
            });
        }
    }
    // A binary that failed without a failing test (it could not start, or crashed between tests).
    for run in &result.binaries {
        let Some(rc) = run.rc.filter(|&rc| rc != 0) else {
            continue;
        };
        let has_failure = result
            .tests
            .iter()
            .any(|t| t.binary == run.name && t.outcome == Outcome::Fail);
        if !has_failure {
            result.tests.push(TestResult {
                binary: run.name.clone(),
                name: "(binary)".to_string(),
                outcome: Outcome::Fail,
                reason: Some(format!("exited with rc={rc} but no test failed")),
            });
        }
    }
    if !result.booted {
        result.error = Some("the kernel never reached stage 2".to_string());
    } else if !done {
        result.error = Some("stage 2 did not finish".to_string());
    }
}

pub fn write_json(path: &Path, result: &KernelResult) -> Result<()> {
    fs::write(path, serde_json::to_string_pretty(result)? + "\n")?;
    Ok(())
}

/// The terminal summary of one kernel.
pub fn print_summary(result: &KernelResult) {
    let verdict = if result.failed() { "FAILED" } else { "ok" };
    println!(
        "== {} ({}): {verdict}: {}{}",
        result.kernel,
        result.release.as_deref().unwrap_or("release unknown"),
        result.totals(),
        result
            .boot_seconds
            .map_or(String::new(), |b| format!(" (up after {b:.1} s)")),
    );
    if let Some(error) = &result.error {
        println!("   error: {error}");
    }
    for note in &result.notes {
        println!("   note: {note}");
    }
    for run in &result.binaries {
        let rc = run
            .rc
            .map_or("did not finish".to_string(), |rc| format!("rc={rc}"));
        println!(
            "   {}: {rc}, {:.1} s",
            run.name,
            run.seconds.unwrap_or_default()
        );
    }
    for test in result
        .tests
        .iter()
        .filter(|t| matches!(t.outcome, Outcome::Fail | Outcome::Skip))
    {
        let what = if test.outcome == Outcome::Fail {
            "FAIL"
        } else {
            "skip"
        };
        let reason = test.reason.as_deref().unwrap_or("");
        println!("   {what} {}::{} {reason}", test.binary, test.name);
    }
    println!("   log: {}", result.log);
}
