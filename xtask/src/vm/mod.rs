//! `cargo xtask vm`: the privileged end-to-end suite on several kernels.
//!
//! Each Debian kernel boots in qemu with the host's root shared read-only, so the test binaries
//! built here run unchanged inside; `host` runs them natively. qemu emulates with one host thread
//! per VM (multi-threaded TCG races the guest kernel's live code patching and panics it now and
//! then), so each kernel's subjects (the modules of the tier binaries) are split over several VMs
//! (`--shards`, shards.rs) and the VMs run side by side, one per core (`--jobs`); the host's own
//! run comes last, alone. Each
//! VM's console goes to target/vm/logs/<kernel>.<shard>.log and runs under its own time limit; a
//! kernel's parsed results, merged, go to target/vm/results/<kernel>.json.

mod console;
mod features;
mod host;
mod initramfs;
mod kernels;
mod lines;
mod model;
mod qemu;
mod report;
mod results;
mod shards;
mod stage2;
#[cfg(test)]
mod tests;

use std::{
    fs,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};

use self::{
    console::Console,
    kernels::Kernel,
    model::{KernelResult, TestBinary},
};

/// What `--kernels` accepts besides the Debian lines: this machine's kernel, without a VM.
const HOST: &str = "host";
/// What `--backends` accepts: the agent's modes.
const BACKENDS: [&str; 3] = ["ebpf", "iptables", "nftables"];
/// Where the report goes when the whole matrix ran unfiltered.
const DEFAULT_REPORT: &str = "docs/results/kernel-support.md";

/// The test binaries of capture-tests, one per tier (tests/tests/TIER/main.rs, one module per
/// subject), from the smallest question a kernel must answer to what needs the node alone.
pub mod tier {
    /// That every program loads, passes the verifier and attaches (the feature probes), and the
    /// netns cookie's two sources agree.
    pub const VERIFIER: &str = "verifier";
    /// What the kernel answers: every hook and both backends on real traffic, the iptables
    /// variants, the acceleration's correctness suite.
    pub const HOOKS: &str = "hooks";
    /// The agent's bookkeeping over the same hooks (the CNI plugin, lifecycles, a live node's
    /// history, limits, upgrades, validate, the image): a kernel that attaches, capture's state as
    /// the subject. Under emulation it costs as much again as the hooks.
    pub const NODE: &str = "node";
    /// capture's user space whatever the kernel (malformed input, the agent's socket, the CNI
    /// defaults, the container runtime, the manifest, the metrics): what it asks of the kernel
    /// the other tiers ask too, so `--scope kernel` leaves it to the host's run.
    pub const USERSPACE: &str = "userspace";
    /// The agent killed at random under churn, its leaks counted in the kernel's node-wide
    /// program, link and map totals: a binary of its own, because no other test may load or
    /// unload anything while it counts. Kernel-independent like [`USERSPACE`].
    pub const CHAOS: &str = "chaos";
    pub const ALL: &[&str] = &[VERIFIER, HOOKS, NODE, USERSPACE, CHAOS];
}

/// Which test binaries the guests run.
#[derive(Clone, Copy, PartialEq, Eq, Debug, clap::ValueEnum)]
pub enum Scope {
    /// The whole suite (what the kernel support table is written from).
    All,
    /// Only what depends on the kernel: the tiers verifier, hooks and node.
    Kernel,
    /// Only what the kernel answers: the tiers verifier and hooks (CI, where `cargo xtask test`
    /// has just run the whole suite on the host).
    Hooks,
    /// Only that every program loads and verifies: the tier verifier.
    Verifier,
}

impl Scope {
    fn includes(self, tier: &str) -> bool {
        match self {
            Self::All => true,
            Self::Kernel => [tier::VERIFIER, tier::HOOKS, tier::NODE].contains(&tier),
            Self::Hooks => [tier::VERIFIER, tier::HOOKS].contains(&tier),
            Self::Verifier => tier == tier::VERIFIER,
        }
    }
}

pub struct Options {
    pub kernels: Vec<String>,
    pub timeout_secs: u64,
    /// Test binaries to run; all when empty.
    pub tests: Vec<String>,
    /// Arguments for every test binary.
    pub filter: Vec<String>,
    pub report: Option<PathBuf>,
    /// VMs booted at the same time.
    pub jobs: usize,
    /// VMs per kernel, each running its share of the test binaries.
    pub shards: usize,
    pub scope: Scope,
    /// Only these backends where a test runs every backend; all when empty.
    pub backends: Vec<String>,
}

/// The workspace root (xtask sits one level below it).
fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask is inside the workspace")
        .to_path_buf()
}

pub fn run(opts: Options) -> Result<()> {
    let all: Vec<&str> = kernels::LINES
        .iter()
        .map(|l| l.label)
        .chain([HOST])
        .collect();
    for kernel in &opts.kernels {
        if !all.contains(&kernel.as_str()) {
            bail!("unknown kernel {kernel}: choose from {}", all.join(","));
        }
    }
    if let Some(unknown) = opts
        .backends
        .iter()
        .find(|b| !BACKENDS.contains(&b.as_str()))
    {
        bail!(
            "unknown backend {unknown}: choose from {}",
            BACKENDS.join(",")
        );
    }
    let root = workspace_root();
    let vm_dir = root.join("target/vm");
    for sub in ["kernels", "logs", "results"] {
        fs::create_dir_all(vm_dir.join(sub))?;
    }
    let binaries = test_binaries(&opts.tests, &opts.filter, opts.scope)?;
    let tests_dir = root.join("tests");
    let timeout = Duration::from_secs(opts.timeout_secs);

    let (host, vms): (Vec<&String>, Vec<&String>) =
        opts.kernels.iter().partition(|k| k.as_str() == HOST);
    let mut finished = run_vms(&vms, &binaries, &opts, &vm_dir, &tests_dir, timeout)?;
    for kernel in host {
        let log = vm_dir.join(format!("logs/{kernel}.log"));
        let every: Vec<&TestBinary> = binaries.iter().collect();
        let mut result = run_host(&log, &every, &opts.filter, &tests_dir, timeout)
            .unwrap_or_else(|e| not_run(kernel, &every, &format!("{e:#}")));
        result.log = relative(&root, &log);
        results::write_json(&vm_dir.join(format!("results/{kernel}.json")), &result)?;
        finished.push((result, vec![log]));
    }
    // In the order asked for, whatever order they finished in.
    let mut all_results = Vec::new();
    for kernel in &opts.kernels {
        let i = finished
            .iter()
            .position(|(r, _)| &r.kernel == kernel)
            .expect("every kernel has a result");
        let (result, logs) = finished.swap_remove(i);
        results::print_summary(&result);
        if result.error.is_some() {
            for log in logs {
                print_tail(&log);
            }
        }
        all_results.push(result);
    }

    let full_matrix = all.iter().all(|k| opts.kernels.iter().any(|o| o == k))
        && opts.tests.is_empty()
        && opts.filter.is_empty()
        && opts.backends.is_empty()
        && opts.scope == Scope::All;
    let report = opts
        .report
        .or_else(|| full_matrix.then(|| root.join(DEFAULT_REPORT)));
    if let Some(path) = report {
        report::write(&path, &all_results)?;
        println!("report: {}", path.display());
    }
    let failed: Vec<&str> = all_results
        .iter()
        .filter(|r| r.failed())
        .map(|r| r.kernel.as_str())
        .collect();
    if !failed.is_empty() {
        bail!("failures on {}", failed.join(", "));
    }
    Ok(())
}

/// Boots every VM of `vms` (each kernel's binaries split in `opts.shards`), `opts.jobs` at a
/// time, and merges each kernel's results, with the logs of its VMs that failed as a whole.
fn run_vms(
    vms: &[&String],
    binaries: &[TestBinary],
    opts: &Options,
    vm_dir: &Path,
    tests_dir: &Path,
    timeout: Duration,
) -> Result<Vec<(KernelResult, Vec<PathBuf>)>> {
    if vms.is_empty() {
        return Ok(Vec::new());
    }
    let root = workspace_root();
    let shards = shards::split(binaries, opts.shards);
    let mut stage2_scripts = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let path = vm_dir.join(format!("stage2.{i}.sh"));
        stage2::write(&path, tests_dir, shard, &opts.filter, &opts.backends)?;
        stage2_scripts.push(path);
    }
    // Fetched and unpacked one at a time, before VMs that share a kernel boot.
    let mut prepared = Vec::new();
    for kernel in vms {
        prepared.push((kernel.as_str(), prepare_kernel(kernel, vm_dir)));
    }
    // Every kernel's shards, in the order asked for: the slowest kernel first keeps the cores
    // busy until the end.
    let jobs: Vec<(&str, usize)> = vms
        .iter()
        .flat_map(|k| (0..shards.len()).map(move |i| (k.as_str(), i)))
        .collect();
    let one_vm = |&(kernel, shard): &(&str, usize)| -> Result<KernelResult> {
        let label = if shards.len() == 1 {
            kernel.to_string()
        } else {
            format!("{kernel}.{shard}")
        };
        let log = vm_dir.join(format!("logs/{label}.log"));
        let expected = &shards[shard];
        let boot = prepared
            .iter()
            .find(|(k, _)| *k == kernel)
            .map(|(_, p)| p)
            .expect("every VM's kernel was prepared");
        let mut result = match boot {
            Ok(boot) => run_vm(
                (kernel, &label),
                boot,
                &log,
                &stage2_scripts[shard],
                expected,
                timeout,
            )
            .unwrap_or_else(|e| not_run(kernel, expected, &format!("{e:#}"))),
            Err(e) => not_run(kernel, expected, &format!("{e:#}")),
        };
        result.log = relative(&root, &log);
        Ok(result)
    };
    let mut parts = crate::in_parallel(&jobs, opts.jobs.max(1), one_vm)?;
    let mut finished = Vec::new();
    for kernel in vms {
        let (mut mine, rest): (Vec<_>, Vec<_>) =
            parts.into_iter().partition(|r| r.kernel == **kernel);
        parts = rest;
        mine.sort_by(|a, b| a.log.cmp(&b.log));
        let failed_logs: Vec<PathBuf> = mine
            .iter()
            .filter(|r| r.error.is_some())
            .map(|r| root.join(&r.log))
            .collect();
        let result = KernelResult::merge(mine, binaries);
        results::write_json(&vm_dir.join(format!("results/{kernel}.json")), &result)?;
        finished.push((result, failed_logs));
    }
    Ok(finished)
}

/// What the committed kernel support table (the whole matrix, run by hand) says of this tree:
/// the commit it ran on, and whether the kernel-facing code changed since. CI, which runs only
/// part of the matrix, prints it at its end.
pub fn kernel_support_notice() -> String {
    let path = workspace_root().join(DEFAULT_REPORT);
    let Ok(page) = fs::read_to_string(&path) else {
        return format!(
            "the whole kernel matrix: {DEFAULT_REPORT} is missing; run `cargo xtask vm`"
        );
    };
    let commit = report::stamped_commit(&page).unwrap_or("an unnamed commit");
    match report::changed_since(&page) {
        Ok(changed) if changed.is_empty() => format!(
            "the whole kernel matrix ({DEFAULT_REPORT}) ran at {commit}; the kernel programs, \
             the loader and the takeover have not changed since"
        ),
        Ok(changed) => format!(
            "notice: the whole kernel matrix ({DEFAULT_REPORT}) ran at {commit}, and since then \
             {} changed: run `cargo xtask vm` and commit its table before calling the issue \
             resolved",
            changed.join(", ")
        ),
        Err(why) => format!(
            "notice: cannot tell what changed since the whole kernel matrix ({DEFAULT_REPORT}): \
             {why}; run `cargo xtask vm` and commit its table"
        ),
    }
}

/// Fetches and unpacks `kernels` (the Debian lines among them) and writes their initramfs, for
/// a later run: CI does it while it compiles.
pub fn fetch(kernels: &[String]) -> Result<()> {
    let vm_dir = workspace_root().join("target/vm");
    fs::create_dir_all(vm_dir.join("kernels"))?;
    for kernel in kernels.iter().filter(|k| k.as_str() != HOST) {
        if !kernels::LINES.iter().any(|l| l.label == kernel) {
            bail!("unknown kernel {kernel}");
        }
        prepare_kernel(kernel, &vm_dir)?;
    }
    Ok(())
}

/// The kernel of a Debian line, fetched and unpacked if need be, and its initramfs.
fn prepare_kernel(kernel: &str, vm_dir: &Path) -> Result<(Kernel, PathBuf)> {
    let line = kernels::LINES
        .iter()
        .find(|l| l.label == kernel)
        .expect("the kernel names were checked");
    let k = kernels::prepare(&vm_dir.join("kernels"), line)?;
    let initrd = vm_dir.join(format!("kernels/{kernel}/initrd.cpio"));
    initramfs::build(&k, &initrd)?;
    Ok((k, initrd))
}

/// Boots one VM of `kernel` (called `label` on the terminal) that runs `stage2` (which runs
/// `binaries`) and reads its log. Errors are set-up failures (qemu could not start), which fail
/// only this VM.
fn run_vm(
    (kernel, label): (&str, &str),
    (k, initrd): &(Kernel, PathBuf),
    log: &Path,
    stage2: &Path,
    binaries: &[&TestBinary],
    timeout: Duration,
) -> Result<KernelResult> {
    let mut console = Console::create(log, label)?;
    let deadline = Instant::now() + timeout;
    println!("vm {label}: booting {} (log {})", k.release, log.display());
    let timed_out = qemu::boot(k, initrd, stage2, deadline, &mut console)?;
    read_back(kernel, console, binaries, timed_out, timeout, true)
}

/// Runs `binaries` on this machine's kernel and reads its log.
fn run_host(
    log: &Path,
    binaries: &[&TestBinary],
    filter: &[String],
    tests_dir: &Path,
    timeout: Duration,
) -> Result<KernelResult> {
    let mut console = Console::create(log, HOST)?;
    let deadline = Instant::now() + timeout;
    let timed_out = host::run(binaries, filter, tests_dir, deadline, &mut console)?;
    read_back(HOST, console, binaries, timed_out, timeout, false)
}

/// The results in a finished console's log. Only a VM boots: on the host the `kernel` line is
/// printed at once, so its boot time means nothing.
fn read_back(
    kernel: &str,
    console: Console,
    binaries: &[&TestBinary],
    timed_out: bool,
    timeout: Duration,
    booted_a_vm: bool,
) -> Result<KernelResult> {
    let finished = console.finish()?;
    let mut result = results::parse(kernel, &finished.text, binaries);
    result.timed_out = timed_out;
    result.seconds = finished.seconds;
    result.boot_seconds = finished.boot_seconds.filter(|_| booted_a_vm);
    if timed_out {
        let error = format!("timed out after {} s", timeout.as_secs());
        result.error = Some(match result.error.take() {
            Some(e) => format!("{error}; {e}"),
            None => error,
        });
    }
    for run in &mut result.binaries {
        run.seconds = finished
            .binary_seconds
            .iter()
            .find(|(name, _)| *name == run.name)
            .map(|(_, s)| *s);
    }
    Ok(result)
}

/// `path` relative to the workspace root, as the summary shows it.
fn relative(root: &Path, path: &Path) -> String {
    path.strip_prefix(root)
        .unwrap_or(path)
        .display()
        .to_string()
}

/// The last lines of a failed kernel's log, where a panic or a set-up error shows.
fn print_tail(log: &Path) {
    const LINES: usize = 15;
    let text = fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<String> = text
        .lines()
        .map(lines::clean)
        .filter(|l| !l.trim().is_empty())
        .collect();
    println!("   last lines of the log:");
    for line in &lines[lines.len().saturating_sub(LINES)..] {
        println!("   | {line}");
    }
}

/// The result of a kernel whose run could not start: every test fails with `error`.
fn not_run(kernel: &str, binaries: &[&TestBinary], error: &str) -> KernelResult {
    println!("vm {kernel}: {error}");
    let mut result = results::parse(kernel, "", binaries);
    result.error = Some(error.to_string());
    result
}

/// Builds capture-tests' integration tests and lists their tests (with the filter and the scope
/// applied). `cargo build --bins` must have run: the tests start capture and capture-cni from there.
fn test_binaries(only: &[String], filter: &[String], scope: Scope) -> Result<Vec<TestBinary>> {
    let tests_dir = workspace_root().join("tests");
    // The whole workspace's test build, as `cargo xtask test` runs it: `-p capture-tests` alone
    // would unify other features (capture-user's dev-dependencies') and compile it all again.
    let out = crate::cargo()
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
