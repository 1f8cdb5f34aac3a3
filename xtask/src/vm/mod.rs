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
mod cross;
mod features;
mod guest_root;
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
mod suite;
#[cfg(test)]
mod tests;

use std::{
    fs,
    path::{Path, PathBuf},
    time::{Duration, Instant},
};

use anyhow::{bail, Result};

use self::{
    console::Console,
    model::{KernelResult, TestBinary},
    qemu::Guest,
};
use crate::image::arch::Arch;

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
    let binaries = suite::test_binaries(&opts.tests, &opts.filter, opts.scope)?;
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

/// The test binaries of each architecture among `vms`' kernels: `binaries` for this machine's,
/// cross-built for the others.
fn binaries_per_arch(
    vms: &[&String],
    binaries: &[TestBinary],
) -> Result<Vec<(Arch, Vec<TestBinary>)>> {
    let mut built: Vec<(Arch, Vec<TestBinary>)> = Vec::new();
    for kernel in vms {
        let arch = kernels::line(kernel)
            .expect("the kernel names were checked")
            .arch;
        if built.iter().any(|(a, _)| *a == arch) {
            continue;
        }
        let own = if arch.is_host() {
            binaries.to_vec()
        } else {
            cross::test_binaries(arch, binaries)?
        };
        built.push((arch, own));
    }
    Ok(built)
}

/// Writes the stage-2 script of each of `arch`'s shards; their paths.
fn stage2_scripts(
    arch: Arch,
    shards: &[Vec<&TestBinary>],
    opts: &Options,
    vm_dir: &Path,
    tests_dir: &Path,
) -> Result<Vec<PathBuf>> {
    let mut scripts = Vec::new();
    for (i, shard) in shards.iter().enumerate() {
        let path = vm_dir.join(format!("stage2.{}.{i}.sh", arch.debian));
        stage2::write(
            &path,
            tests_dir,
            shard,
            &opts.filter,
            &opts.backends,
            arch.is_host(),
        )?;
        scripts.push(path);
    }
    Ok(scripts)
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
    // Each architecture's own test binaries, its shards and their stage-2 scripts.
    let built = binaries_per_arch(vms, binaries)?;
    let mut plans = Vec::new();
    for (arch, own) in &built {
        let shards = shards::split(own, opts.shards);
        let scripts = stage2_scripts(*arch, &shards, opts, vm_dir, tests_dir)?;
        plans.push((*arch, own, shards, scripts));
    }
    let plan_of = |kernel: &str| {
        let arch = kernels::line(kernel)
            .expect("the kernel names were checked")
            .arch;
        plans
            .iter()
            .find(|p| p.0 == arch)
            .expect("every architecture has a plan")
    };
    // Fetched and unpacked one at a time, before VMs that share a kernel boot.
    let mut prepared = Vec::new();
    for kernel in vms {
        prepared.push((kernel.as_str(), prepare_kernel(kernel, vm_dir)));
    }
    // Every kernel's shards, in the order asked for: the slowest kernel first keeps the cores
    // busy until the end.
    let jobs: Vec<(&str, usize)> = vms
        .iter()
        .flat_map(|k| (0..plan_of(k).2.len()).map(move |i| (k.as_str(), i)))
        .collect();
    let one_vm = |&(kernel, shard): &(&str, usize)| -> Result<KernelResult> {
        let (_, _, shards, scripts) = plan_of(kernel);
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
            Ok(guest) => run_vm(
                (kernel, &label),
                guest,
                &log,
                &scripts[shard],
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
        let result = KernelResult::merge(mine, plan_of(kernel).1);
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
    // The arm64 kernels joined the matrix later: a page from before names none.
    let arches = if page.contains(&format!("{} = `", report::ARM64_SUFFIX)) {
        "amd64 and arm64 kernels"
    } else {
        "amd64 kernels only: arm64 has not run"
    };
    match report::changed_since(&page) {
        Ok(changed) if changed.is_empty() => format!(
            "the whole kernel matrix ({DEFAULT_REPORT}; {arches}) ran at {commit}; the kernel \
             programs, the loader and the takeover have not changed since"
        ),
        Ok(changed) => format!(
            "notice: the whole kernel matrix ({DEFAULT_REPORT}; {arches}) ran at {commit}, and \
             since then {} changed: run `cargo xtask vm` and commit its table before calling the \
             issue resolved",
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
        if kernels::line(kernel).is_none() {
            bail!("unknown kernel {kernel}");
        }
        prepare_kernel(kernel, &vm_dir)?;
    }
    Ok(())
}

/// The kernel of a Debian line, fetched and unpacked if need be, its initramfs, and the root it
/// runs on (another architecture's fetched and unpacked too).
fn prepare_kernel(kernel: &str, vm_dir: &Path) -> Result<Guest> {
    let line = kernels::line(kernel).expect("the kernel names were checked");
    let k = kernels::prepare(&vm_dir.join("kernels"), line)?;
    let initrd = vm_dir.join(format!("kernels/{kernel}/initrd.cpio"));
    let root = if line.arch.is_host() {
        PathBuf::from("/")
    } else {
        guest_root::prepare(line.arch, &qemu::guest_shares(&workspace_root())?)?
            .root()
            .to_path_buf()
    };
    initramfs::build(
        &k,
        (!line.arch.is_host()).then_some(root.as_path()),
        &initrd,
    )?;
    Ok(Guest {
        kernel: k,
        initrd,
        arch: line.arch,
        root,
    })
}

/// Boots one VM of `kernel` (called `label` on the terminal) that runs `stage2` (which runs
/// `binaries`) and reads its log. Errors are set-up failures (qemu could not start), which fail
/// only this VM.
fn run_vm(
    (kernel, label): (&str, &str),
    guest: &Guest,
    log: &Path,
    stage2: &Path,
    binaries: &[&TestBinary],
    timeout: Duration,
) -> Result<KernelResult> {
    let mut console = Console::create(log, label)?;
    let deadline = Instant::now() + timeout;
    println!(
        "vm {label}: booting {} (log {})",
        guest.kernel.release,
        log.display()
    );
    let timed_out = qemu::boot(guest, stage2, deadline, &mut console)?;
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
