//! capture's developer tasks:
//! `cargo xtask setup|setup-check|build|test|lint|fuzz|demo|bench|vm|image|release|completions`.
//!
//! Every task that needs the toolchain runs `setup` first, so a fresh machine needs nothing but
//! rustup, cargo and root.

mod builds;
mod ci;
mod completions;
mod cycles;
mod deny;
mod doclinks;
mod fuzz;
mod image;
mod layers;
mod lint;
mod release;
mod setup;
mod testing;
mod vm;

use std::process::Command;

use anyhow::{bail, Context as _, Result};
use builds::{build, build_all};
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(name = "cargo xtask")]
struct Args {
    #[command(subcommand)]
    task: Task,
}

#[derive(Subcommand)]
enum Task {
    /// Install what building and testing need (idempotent; a fast no-op when all is present).
    Setup {
        /// Also what `cargo xtask vm` needs (qemu, kmod, busybox-static, ...).
        #[arg(long)]
        vm: bool,
        /// Only the Debian packages and the commands they provide: no Rust toolchain pieces, no
        /// PyPI (what `setup-check` runs inside a clean root).
        #[arg(long)]
        debian_only: bool,
    },
    /// Run setup's Debian step in a clean root of this machine's Debian release (debootstrap,
    /// then chroot) and fail if any command the tasks and tests run is missing afterwards
    /// (needs root; a few minutes, most of it downloads).
    SetupCheck,
    /// Build every binary of the default members (the kernel programs are built and embedded by
    /// capture-user's build.rs; capture-ebpf itself only builds for BPF), and the two other
    /// builds of `capture` the upgrade tests use: the next-layout variant and the previous
    /// release (from the git history).
    Build,
    /// Run every test: unit tests and the privileged end-to-end suite (needs root).
    Test {
        /// Run the suite this many times and name every test that did not pass in each round.
        #[arg(long, default_value_t = 1)]
        repeat: usize,
        /// Extra arguments for `cargo test` (e.g. a test name filter).
        #[arg(trailing_var_arg = true)]
        args: Vec<String>,
    },
    /// cargo fmt --check and clippy -D warnings: user side, kernel side, and the fuzz crate.
    Lint,
    /// Run every fuzz target of fuzz/ (cargo-fuzz, nightly) for a while on a scratch copy of its
    /// committed corpus; fails on any crash, hang or out-of-memory, naming the saved input.
    Fuzz {
        /// How long each target runs: `30s`, `5m`, `1h`.
        #[arg(long, default_value = "60s", value_parser = fuzz::parse_duration)]
        time: std::time::Duration,
        /// Only these targets (comma-separated or repeated).
        #[arg(long, value_delimiter = ',')]
        target: Vec<String>,
        /// Also write the summary (target, execs, seconds, corpus size) as JSON here.
        #[arg(long)]
        json: Option<std::path::PathBuf>,
        /// Build the targets without optimizations (with overflow checks): about half the build
        /// time and fewer executions per second, for a short smoke such as CI's.
        #[arg(long)]
        dev: bool,
    },
    /// What CI runs (`.ci/run`): setup, lint, a fuzz smoke, setup-check, the builds, every test,
    /// the image's reproducibility and the kernel matrix (5.10's hooks, 6.1's and 6.12's
    /// verifier), each step timed against its share of the budget (needs root).
    Ci,
    /// Capture a demo pod's traffic and show it (needs root).
    Demo,
    /// Build the node agent's container image (capture and capture-cni linked statically, the
    /// iptables variants, ip and nsenter) as an OCI archive that containerd imports; prints its
    /// name, digest and size. Two builds of one commit give the same digest.
    Image {
        /// Where to write the archive (default target/image/capture.oci.tar).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
        /// Build it twice, compiling the binaries afresh for the second, and fail unless both
        /// give the same digest.
        #[arg(long, conflicts_with = "out")]
        check_reproducible: bool,
    },
    /// Write everything a release publishes into one directory: the image archive, the static
    /// binaries, man pages and completions, deploy/'s manifests with the image pinned by tag and
    /// digest, a CycloneDX SBOM, the release note and SHA256SUMS (docs/using/install.md).
    Release {
        /// The directory: new, empty, or a previous release (replaced); anything else is refused.
        #[arg(long)]
        out: std::path::PathBuf,
        /// The image's repository as the manifests name it (where you push the archive).
        #[arg(long, default_value = image::REPOSITORY)]
        repository: String,
    },
    /// Write shell completions (capture.bash, _capture for zsh, capture.fish) and man pages
    /// (man/capture.1 and one per subcommand: capture-attach.1, ...) for the `capture` CLI,
    /// generated from its own definition: builds `capture`, then runs it.
    Completions {
        /// Where to write them (default target/dist).
        #[arg(long)]
        out: Option<std::path::PathBuf>,
    },
    /// Benchmark ebpf against iptables and no capture; writes docs/results/benchmarks.{md,svg} and
    /// docs/results/results.json (needs root).
    Bench(BenchArgs),
    /// Run the privileged end-to-end suite on Debian's 5.10, 6.1 and 6.12 kernels in qemu VMs
    /// (also as arm64 builds, emulated) and on this machine's kernel; writes
    /// target/vm/results/<kernel>.json and the kernel support table (needs root).
    Vm(VmArgs),
}

/// Runs a command and returns its trimmed stdout, failing with its stderr.
pub fn output(cmd: &mut Command) -> Result<String> {
    let out = cmd.output().with_context(|| format!("running {cmd:?}"))?;
    if !out.status.success() {
        bail!(
            "{cmd:?} failed: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs a command, failing with its name if it does not succeed.
pub fn run(cmd: &mut Command) -> Result<()> {
    let status = cmd.status().with_context(|| format!("running {cmd:?}"))?;
    if !status.success() {
        bail!("{cmd:?} failed ({status})");
    }
    Ok(())
}

/// Runs `work` on every item, at most `jobs` at a time; the results in the items' order.
pub fn in_parallel<T: Sync, R: Send>(
    items: &[T],
    jobs: usize,
    work: impl Fn(&T) -> Result<R> + Sync,
) -> Result<Vec<R>> {
    let next = std::sync::atomic::AtomicUsize::new(0);
    let results = std::sync::Mutex::new(Vec::new());
    std::thread::scope(|s| {
        for _ in 0..jobs.clamp(1, items.len().max(1)) {
            s.spawn(|| loop {
                let i = next.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let Some(item) = items.get(i) else { break };
                let r = work(item);
                results.lock().expect("no worker panicked").push((i, r));
            });
        }
    });
    let mut results = results.into_inner().expect("no worker panicked");
    results.sort_by_key(|(i, _)| *i);
    results.into_iter().map(|(_, r)| r).collect()
}

/// `cargo`, with the kernel programs of every configuration built in one shared directory
/// (`builds::ebpf_target_dir`).
pub fn cargo() -> Command {
    let mut cmd = Command::new(std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into()));
    if let Ok(dir) = builds::ebpf_target_dir() {
        cmd.env("CAPTURE_EBPF_TARGET_DIR", dir);
    }
    cmd
}

/// The features the end-to-end tests need of the binaries they run: the test-only switches stay
/// out of every other build (a release build at the workspace root among them).
pub const TEST_FEATURES: [&str; 2] = ["--features", "capture-user/test-hooks"];

pub fn require_root(what: &str) -> Result<()> {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("{what} loads BPF programs and creates network namespaces: run it as root");
    }
    Ok(())
}

fn main() -> std::process::ExitCode {
    match run_task(Args::parse().task) {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}

fn run_task(task: Task) -> Result<()> {
    match task {
        Task::Setup { vm, debian_only } => {
            // setup() installs the test tools itself; --debian-only installs them here instead.
            let mut tools = Vec::new();
            if debian_only {
                tools.extend_from_slice(setup::tools::TEST_TOOLS);
                tools.extend(setup::cross_compilers());
            } else {
                setup::setup()?;
            }
            if vm {
                tools.extend_from_slice(setup::tools::VM_TOOLS);
            }
            setup::install(&tools)
        }
        Task::SetupCheck => {
            require_root("cargo xtask setup-check")?;
            setup::check::run_check(std::path::Path::new("target/setup-check"))
        }
        Task::Build => {
            setup::setup()?;
            build_all()
        }
        Task::Test { repeat, args } => {
            require_root("cargo xtask test")?;
            setup::setup()?;
            build_all()?;
            // The release the tests check (tests/userspace/release.rs), its image among it.
            release::write(&release::Options::for_tests())?;
            testing::test(&args, repeat)
        }
        Task::Lint => {
            setup::setup()?;
            lint::lint()
        }
        Task::Fuzz {
            time,
            target,
            json,
            dev,
        } => {
            setup::fuzz_setup()?;
            fuzz::run_fuzz(&fuzz::Options {
                time,
                targets: target,
                json,
                dev,
            })
        }
        Task::Image {
            out,
            check_reproducible,
        } => {
            setup::setup()?;
            if check_reproducible {
                image::check_reproducible()
            } else {
                image::build(&image::Options { out }).map(|_| ())
            }
        }
        Task::Release { out, repository } => {
            setup::setup()?;
            release::write(&release::Options { out, repository }).map(|_| ())
        }
        Task::Completions { out } => {
            setup::kernel_build_setup()?;
            completions::write(&out.unwrap_or_else(|| builds::target_dir().join("dist")))
        }
        Task::Bench(args) => bench(args),
        Task::Vm(args) => vm_task(args),
        Task::Ci => ci::run(),
        Task::Demo => {
            require_root("cargo xtask demo")?;
            setup::setup()?;
            build()?;
            run(cargo()
                .args(["run", "--quiet", "--locked", "-p", "capture-tests"])
                .args(TEST_FEATURES)
                .args(["--bin", "capture-demo"]))
        }
    }
}

/// The workspace's root directory.
fn workspace() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("xtask sits in the workspace")
        .to_path_buf()
}

/// `cargo xtask bench`'s arguments.
#[derive(Debug, clap::Args)]
struct BenchArgs {
    /// A short run (under two minutes) for a quick check.
    #[arg(long)]
    quick: bool,
    /// Where to write the results.
    #[arg(long, default_value = "docs/results")]
    out: String,
    /// Measure only what tracing costs: connection churn with the programs loaded without
    /// tracing, with it built in and off, and with the pod traced; writes trace-cost.md.
    #[arg(long)]
    trace_cost: bool,
    /// Measure only the CPU of one reconcile pass over a synthetic node of 1,000 pod
    /// sandboxes; writes reconcile-cost.md.
    #[arg(long, conflicts_with = "trace_cost")]
    reconcile_cost: bool,
    /// Measure only what proxy identity by container costs: connection churn with the proxy
    /// exempt by uid and by its container's cgroup; writes identity-cost.md.
    #[arg(long, conflicts_with_all = ["trace_cost", "reconcile_cost"])]
    identity_cost: bool,
    /// Measure only churn and request/response end to end, with Debian's HAProxy as the
    /// pod's sidecar, against no mesh; writes real-proxy.md and real-proxy.json.
    #[arg(long, conflicts_with_all = ["trace_cost", "reconcile_cost", "identity_cost"])]
    real_proxy: bool,
    /// Measure only a node of 1,000 captured pods: ADD time first to last, memory per pod, a
    /// reconcile pass, and the next build's takeover under traffic; writes node-scale.md.
    #[arg(long, conflicts_with_all = ["trace_cost", "reconcile_cost", "identity_cost", "real_proxy"])]
    node_scale: bool,
}

/// `cargo xtask vm`'s arguments.
#[derive(Debug, clap::Args)]
struct VmArgs {
    /// Kernels to test, in this order: `5.10`, `6.1`, `6.12` boot in a VM (fetched once and
    /// cached under target/vm), `5.10-arm64`, `6.1-arm64` and `6.12-arm64` boot Debian's arm64
    /// builds in an emulated arm64 VM (the tiers verifier and hooks, cross-built), `host` runs
    /// natively.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "5.10,6.1,6.12,5.10-arm64,6.1-arm64,6.12-arm64,host"
    )]
    kernels: Vec<String>,
    /// Time limit per VM: one that panics or hangs fails with its log after this long, and
    /// the run goes on with the next. 5.10 under emulation needs about an hour for the
    /// whole suite, in two VMs of about half an hour each when they have a core each.
    #[arg(long, default_value_t = 5400)]
    timeout_secs: u64,
    /// Only these subjects (the modules of tests/tests/TIER/, e.g. outbound), for a quick run.
    #[arg(long, value_delimiter = ',')]
    tests: Vec<String>,
    /// Arguments for every test binary, split at whitespace (a name filter, `--exact`, ...).
    #[arg(long, allow_hyphen_values = true)]
    filter: Option<String>,
    /// Where to write the kernel support table. Without it, the table goes to
    /// docs/results/kernel-support.md only when every kernel ran the whole suite (no
    /// --tests, --filter or --scope other than all).
    #[arg(long)]
    report: Option<std::path::PathBuf>,
    /// VMs running at once (each emulates on one host thread); by default one per core.
    #[arg(long)]
    jobs: Option<usize>,
    /// VMs per kernel, each running its share of the subjects, so that the cores stay
    /// busy until the slowest kernel is done.
    #[arg(long, default_value_t = 2)]
    shards: usize,
    /// `all` runs the whole suite; `kernel` leaves out the binaries whose subject is user
    /// space (chaos, containerd, `bad_input`, ...); `hooks` runs only those whose subject is
    /// what the kernel answers (outbound, parity, accel, ...: CI's matrix on 5.10 takes the
    /// subjects its programs' own paths decide, with `--backends ebpf`);
    /// `verifier` only the feature probes (every program loads: CI's on 6.1 and 6.12).
    #[arg(long, value_enum, default_value = "all")]
    scope: vm::Scope,
    /// Only these backends in the tests that run every backend (`ebpf`, `iptables`,
    /// `nftables`): the guests' `CAPTURE_TEST_BACKENDS`.
    #[arg(long, value_delimiter = ',')]
    backends: Vec<String>,
    /// Only fetch and unpack the kernels (and write their initramfs) for a later run.
    #[arg(long)]
    fetch_only: bool,
}

/// `cargo xtask bench`: builds the benchmark and what it starts, then runs the one asked for.
fn bench(args: BenchArgs) -> Result<()> {
    let BenchArgs {
        quick,
        out,
        trace_cost,
        reconcile_cost,
        identity_cost,
        real_proxy,
        node_scale,
    } = args;
    require_root("cargo xtask bench")?;
    setup::setup()?;
    // Before the other builds: it leaves target/release/capture to them.
    let variant = if node_scale {
        Some(builds::build_release_variant()?)
    } else {
        None
    };
    // The driver and every binary it starts: capture (the agent and CLI), capture-cni,
    // and the tests' capture-probe.
    run(cargo().args([
        "build",
        "--release",
        "--locked",
        "--bins",
        "-p",
        "capture-bench",
        "-p",
        "capture",
        "-p",
        "capture-cni",
        "-p",
        "capture-tests",
    ]))?;
    if real_proxy {
        let mut cmd = Command::new("target/release/capture-bench");
        cmd.args(["real-proxy", "--out", &out]);
        if quick {
            cmd.arg("--quick");
        }
        return run(&mut cmd);
    }
    if let Some(variant) = variant {
        return run(Command::new("target/release/capture-bench")
            .args(["node-scale", "--out", &out, "--variant"])
            .arg(variant));
    }
    if reconcile_cost {
        return run(Command::new("target/release/capture-bench").args([
            "reconcile-cost",
            "--out",
            &out,
        ]));
    }
    let mut cmd = Command::new("target/release/capture-bench");
    cmd.args(["run", "--out", &out]);
    if quick {
        cmd.arg("--quick");
    }
    if trace_cost {
        cmd.args([
            "--focus",
            "connect+rr+close",
            "--modes",
            "ebpf-notrace,ebpf,ebpf-trace",
        ]);
    }
    if identity_cost {
        cmd.args([
            "--focus",
            "connect+rr+close",
            "--modes",
            "ebpf,ebpf-identity",
        ]);
    }
    run(&mut cmd)
}

/// `cargo xtask vm`: the kernel matrix (or only its kernels' download).
fn vm_task(args: VmArgs) -> Result<()> {
    let VmArgs {
        kernels,
        timeout_secs,
        tests,
        filter,
        report,
        jobs,
        shards,
        scope,
        backends,
        fetch_only,
    } = args;
    require_root("cargo xtask vm")?;
    if fetch_only {
        setup::install(setup::tools::VM_TOOLS)?;
        return vm::fetch(&kernels);
    }
    setup::setup()?;
    setup::install(setup::tools::VM_TOOLS)?;
    build_all()?;
    // The image and the release its tests check, as `cargo xtask test` writes them: a release
    // left from another commit would fail them.
    release::write(&release::Options::for_tests())?;
    vm::run(vm::Options {
        kernels,
        timeout_secs,
        tests,
        filter: filter
            .as_deref()
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        report,
        jobs: jobs.unwrap_or_else(|| {
            std::thread::available_parallelism().map_or(2, std::num::NonZero::get)
        }),
        shards,
        scope,
        backends,
    })
}
