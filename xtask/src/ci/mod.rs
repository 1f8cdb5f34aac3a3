//! `cargo xtask ci`: what `.ci/run` runs on a clean clone, as root, every step timed.
//!
//! The steps are those of `cargo xtask setup`, `lint`, `fuzz --time 5s --dev`, `test` (its build
//! and its run as two steps), `image --check-reproducible` and the kernel matrix, each run once:
//! one process, so no build is done twice. Work that waits on the network or the disk runs
//! beside the compiling (apt beside the Rust tools' builds; the kernels' download and
//! `setup-check` beside lint, fuzz and the builds), in child processes whose output goes to
//! `target/ci/<name>.log` and is shown when they fail. The run ends with a table of every step's
//! time against its share of the budget (budget.rs) and the machine's calibration figure.

mod budget;
mod calibrate;
mod cpu;

use std::{
    fs::File,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use anyhow::{bail, Context as _, Result};
use budget::StepTime;

use crate::{builds, fuzz, lint, release, setup, testing, vm};

/// The kernel matrix on every submission: 5.10, whose programs take other paths than the
/// host's (it lacks the 5.15 features), runs what those programs answer (`HOOKS_SUBJECTS`, on
/// the ebpf backend); 6.1 and 6.12, which take the host's paths, run the verifier's part. The
/// whole suite on every kernel, the rule backends' netfilter included, is `cargo xtask vm`, run
/// by hand (docs/results/kernel-support.md says at which commit, and CI's notice whether the
/// kernel programs changed since).
const HOOKS_KERNELS: &[&str] = &["5.10"];
const VERIFIER_KERNELS: &[&str] = &["6.1", "6.12"];

/// The subjects whose answers on 5.10 come from the paths its programs take there: the netns
/// cookie's fallback (every hook's first step: outbound and parity), owners recorded at socket
/// creation, the stateful redirect only, the acceleration's `sk_msg`, with the verifier tier's
/// probes. The hooks tier's other subjects are the rule backends' (tproxy, nftables,
/// `iptables_variant`, interfaces, `multi_network`), a real proxy or a load balancer in front of
/// the same hooks (haproxy, coexistence), or DNS and owner groups (`dns_and_groups`: the UDP
/// hooks take the same cookie fallback as outbound, the groups the same owner path as
/// `owner_identity`).
const HOOKS_SUBJECTS: &[&str] = &[
    "kernel_compat",
    "outbound",
    "parity",
    "owner_identity",
    "proxy_identity",
    "sockopt_answers",
    "stateless_redirect",
    "trace",
    "userns",
    "accel",
];

/// A VM that takes longer than this has hung: 5.10's VMs take about 4 minutes on the reference
/// machine, 9 on the slowest.
const VM_TIMEOUT: Duration = Duration::from_mins(20);

/// Where the background steps' logs, the calibration program and the times go.
fn ci_dir() -> PathBuf {
    builds::target_dir().join("ci")
}

/// The steps run so far, and what their failure stops.
struct Run {
    steps: Vec<StepTime>,
    calibrations: Vec<Duration>,
}

impl Run {
    /// Runs `work` as the step `name`, timing it.
    fn step(&mut self, name: &str, work: impl FnOnce(&mut Self) -> Result<()>) -> Result<()> {
        println!("ci: == {name}");
        let before = cpu::Stat::read();
        let started = Instant::now();
        let result = work(self);
        let wall = started.elapsed();
        let busy = before.and_then(|b| Some(cpu::Stat::read()?.since(&b).busy()));
        println!("ci: == {name}: {:.0} s", wall.as_secs_f64());
        self.steps.push(StepTime {
            name: name.to_string(),
            wall,
            busy,
            background: false,
            failed: result.is_err(),
        });
        result.with_context(|| format!("CI step `{name}`"))
    }
}

/// How a background job shares the CPUs with the steps.
#[derive(Clone, Copy)]
enum Priority {
    Normal,
    /// Linux's idle scheduling class (`chrt --idle 0`, inherited by every process it starts):
    /// the CPU time the steps leave unused and no more. It still shares the caches, the memory
    /// and the disk: the tests took 45 s longer beside the image check (docs/working-on/ci.md).
    Idle,
}

impl Priority {
    fn command(self, exe: &Path) -> Command {
        match self {
            Self::Normal => Command::new(exe),
            Self::Idle => {
                let mut chrt = Command::new("chrt");
                chrt.args(["--idle", "0"]).arg(exe);
                chrt
            }
        }
    }
}

/// `xtask` subcommands run one after the other in a child process, beside the steps.
struct Background {
    name: &'static str,
    log: PathBuf,
    handle: std::thread::JoinHandle<Vec<(String, Duration, Result<()>)>>,
}

impl Background {
    fn start(name: &'static str, commands: Vec<(&'static str, Vec<String>)>) -> Result<Self> {
        Self::start_at(name, commands, Priority::Normal)
    }

    fn start_at(
        name: &'static str,
        commands: Vec<(&'static str, Vec<String>)>,
        priority: Priority,
    ) -> Result<Self> {
        let log = ci_dir().join(format!("{name}.log"));
        let file = File::create(&log).with_context(|| format!("creating {}", log.display()))?;
        let exe = own_copy()?;
        println!("ci: beside the steps: {name} (log {})", log.display());
        let handle = std::thread::spawn(move || {
            let mut done = Vec::new();
            for (label, args) in commands {
                let started = Instant::now();
                let result = file
                    .try_clone()
                    .and_then(|out| Ok((out.try_clone()?, out)))
                    .context("the log file")
                    .and_then(|(out, err)| {
                        let status = priority
                            .command(&exe)
                            .args(&args)
                            .stdin(Stdio::null())
                            .stdout(out)
                            .stderr(err)
                            .status()
                            .with_context(|| format!("running xtask {}", args.join(" ")))?;
                        if !status.success() {
                            bail!("xtask {} failed ({status})", args.join(" "));
                        }
                        Ok(())
                    });
                let failed = result.is_err();
                done.push((label.to_string(), started.elapsed(), result));
                if failed {
                    break;
                }
            }
            done
        });
        Ok(Self { name, log, handle })
    }

    /// Waits for it, adds its commands to the table, and fails with its log's end if one failed.
    fn join(self, run: &mut Run) -> Result<()> {
        let done = self
            .handle
            .join()
            .map_err(|_| anyhow::anyhow!("the thread running {} panicked", self.name))?;
        let mut failure = None;
        for (label, wall, result) in done {
            run.steps.push(StepTime {
                name: label,
                wall,
                busy: None,
                background: true,
                failed: result.is_err(),
            });
            if let Err(e) = result {
                failure = Some(e);
            }
        }
        if let Some(e) = failure {
            print_tail(&self.log);
            return Err(e.context(format!("{} (log {})", self.name, self.log.display())));
        }
        Ok(())
    }
}

/// A copy of this xtask binary, made on first use, for the background jobs to run: the test
/// step's build links target/debug/xtask again (the workspace's binaries, with the test
/// features), and a job started after it would find the file it was started from gone.
fn own_copy() -> Result<PathBuf> {
    static COPY: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    if let Some(copy) = COPY.get() {
        return Ok(copy.clone());
    }
    let exe = std::env::current_exe().context("finding the xtask binary")?;
    let copy = std::path::absolute(ci_dir().join("xtask"))?;
    std::fs::copy(&exe, &copy)
        .with_context(|| format!("copying {} to {}", exe.display(), copy.display()))?;
    Ok(COPY.get_or_init(|| copy).clone())
}

fn print_tail(log: &Path) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    println!("ci: the last lines of {}:", log.display());
    for line in &lines[lines.len().saturating_sub(40)..] {
        println!("   | {line}");
    }
}

/// When `.ci/run` started (`CAPTURE_CI_STARTED`, seconds since the epoch), so that building
/// xtask itself shows in the table too.
fn ci_started() -> Option<std::time::SystemTime> {
    let secs: f64 = std::env::var("CAPTURE_CI_STARTED")
        .ok()?
        .trim()
        .parse()
        .ok()?;
    Some(std::time::UNIX_EPOCH + Duration::from_secs_f64(secs))
}

pub fn run() -> Result<()> {
    let started = Instant::now();
    let since_ci_start = ci_started().and_then(|t| t.elapsed().ok());
    let first = cpu::Stat::read();
    std::fs::create_dir_all(ci_dir())?;
    let mut run = Run {
        steps: Vec::new(),
        calibrations: Vec::new(),
    };
    if let Some(before) = since_ci_start {
        run.steps.push(StepTime {
            name: "xtask".into(),
            wall: before,
            busy: None,
            background: false,
            failed: false,
        });
    }
    let result = steps(&mut run);
    // The machine's speed again at the end: a shared host may have slowed down meanwhile.
    if result.is_ok() {
        let _ = run.step("calibration", calibrate_into);
    }
    let total = started.elapsed() + since_ci_start.unwrap_or_default();
    let steal = first.and_then(|f| Some(cpu::Stat::read()?.since(&f).steal()));
    // Both calibration runs are one row.
    let mut rows: Vec<StepTime> = Vec::new();
    for s in run.steps {
        match rows.iter_mut().find(|r| r.name == s.name && !s.background) {
            Some(r) => {
                r.wall += s.wall;
                r.failed |= s.failed;
            }
            None => rows.push(s),
        }
    }
    println!();
    print!("{}", budget::table(&rows, &run.calibrations, steal, total));
    println!("{}", vm::kernel_support_notice());
    result
}

fn calibrate_into(run: &mut Run) -> Result<()> {
    let took = calibrate::measure(&ci_dir().join("calibration"))?;
    println!("ci: calibration: {:.1} s", took.as_secs_f64());
    run.calibrations.push(took);
    Ok(())
}

fn steps(run: &mut Run) -> Result<()> {
    crate::require_root("cargo xtask ci")?;
    run.step("calibration", calibrate_into)?;
    run.step("setup", |run| {
        let apt = Background::start(
            "debian-packages",
            vec![(
                "apt: test and VM tools",
                args(&["setup", "--debian-only", "--vm"]),
            )],
        )?;
        let rust = setup::rust_tools();
        apt.join(run)?;
        rust?;
        // After the background apt: the cross compiler is a Debian package too (one dpkg at a
        // time).
        setup::image_platforms()?;
        setup::python_tools()
    })?;
    let beside = Background::start(
        "kernels-and-setup-check",
        vec![
            (
                "kernels fetched",
                args(&[
                    "vm",
                    "--fetch-only",
                    "--kernels",
                    &[HOOKS_KERNELS, VERIFIER_KERNELS].concat().join(","),
                ]),
            ),
            ("setup-check", args(&["setup-check"])),
        ],
    )?;
    let result = (|| {
        run.step("lint", |_| lint::lint())?;
        run.step("fuzz smoke", |_| {
            fuzz::run_fuzz(&fuzz::Options {
                time: Duration::from_secs(5),
                targets: Vec::new(),
                json: None,
                dev: true,
            })
        })?;
        run.step("build", |_| {
            builds::build_all()?;
            release::write(&release::Options::for_tests()).map(|_| ())
        })?;
        // The image built again from nothing, beside the tests: they leave about 40% of the CPUs
        // unused (waiting on sockets, sandboxes and timers), and the rebuild touches nothing
        // they read (its archives have their own names, its binaries their own directory).
        let image_check = Background::start_at(
            "image-check",
            vec![(
                "image built again: one digest",
                args(&["image", "--check-reproducible"]),
            )],
            Priority::Idle,
        )?;
        let tests = run.step("test", |_| testing::test(&[], 1));
        // What the rebuild has left when the tests end, it does with the whole machine.
        let checked = run.step("image check", |run| image_check.join(run));
        tests.and(checked)
    })();
    // Whatever happened, the child processes end before the table.
    let joined = beside.join(run);
    result?;
    joined?;
    run.step("kernel matrix", |_| {
        let hooks = vm::run(vm::Options {
            tests: HOOKS_SUBJECTS.iter().map(|s| (*s).to_string()).collect(),
            backends: vec!["ebpf".into()],
            ..matrix_options(HOOKS_KERNELS, vm::Scope::Hooks)
        });
        let verifier = vm::run(matrix_options(VERIFIER_KERNELS, vm::Scope::Verifier));
        hooks.and(verifier)
    })
}

fn args(words: &[&str]) -> Vec<String> {
    words.iter().map(|w| (*w).to_string()).collect()
}

fn matrix_options(kernels: &[&str], scope: vm::Scope) -> vm::Options {
    vm::Options {
        kernels: kernels.iter().map(|k| (*k).to_string()).collect(),
        timeout_secs: VM_TIMEOUT.as_secs(),
        tests: Vec::new(),
        filter: Vec::new(),
        report: None,
        jobs: std::thread::available_parallelism().map_or(2, std::num::NonZero::get),
        shards: 2,
        scope,
        backends: Vec::new(),
    }
}
