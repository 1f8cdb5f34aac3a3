//! The acceleration's correctness checks: every case of `cases` runs in a scratch pod captured
//! by this node's programs, once plain and once accelerated, and the two answers must be the
//! same. A kernel where any case differs gets no acceleration.

use std::{
    collections::BTreeMap,
    fs::File,
    io,
    os::{fd::AsRawFd as _, unix::process::CommandExt as _},
    path::Path,
    process::{Command, Stdio},
    time::Duration,
};

use serde::Serialize;

use super::{cases::Observation, FailedCase, Verdict};
use crate::{
    backend::PodTarget,
    cgroup::{CgroupJoin, ScratchCgroup},
    config::{CaptureConfig, PodSpec},
    ebpf::EbpfBackend,
    paths::Paths,
};

/// Where the cases' app connects; capture sends it to the scratch pod's proxy listener.
pub const DESTINATION: &str = "10.255.255.1:80";

/// The scratch pod's address (never configured on an interface: the cases stay on loopback).
const SCRATCH_POD_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(10, 255, 255, 2);

/// One case, both ways.
#[derive(Clone, Debug, Serialize)]
pub struct CaseResult {
    pub name: String,
    pub passed: bool,
    pub plain: Result<Observation, String>,
    pub accelerated: Result<Observation, String>,
}

#[derive(Clone, Debug, Serialize)]
pub struct Report {
    pub kernel: String,
    pub build: String,
    pub cases: Vec<CaseResult>,
    /// Bytes the accelerated run moved through the `sk_msg` program: zero means acceleration
    /// never took, and the comparison proved nothing.
    pub accelerated_bytes: u64,
    pub passed: bool,
}

impl Report {
    #[must_use]
    pub fn verdict(&self) -> Verdict {
        let show = |r: &Result<Observation, String>| match r {
            Ok(lines) => lines.join("; "),
            Err(e) => format!("could not run: {e}"),
        };
        Verdict {
            kernel: self.kernel.clone(),
            build: self.build.clone(),
            cases: self.cases.len(),
            failed: self
                .cases
                .iter()
                .filter(|c| !c.passed)
                .map(|c| FailedCase {
                    name: c.name.clone(),
                    plain: show(&c.plain),
                    accelerated: show(&c.accelerated),
                })
                .collect(),
            accelerated_bytes: self.accelerated_bytes,
            checked_at_unix: crate::record::now_unix(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error("the acceleration checks need the ebpf backend: {0}")]
    Ebpf(#[from] crate::ebpf::EbpfError),
    #[error("the acceleration checks: {what}: {source}")]
    Io {
        what: &'static str,
        source: io::Error,
    },
    #[error("the acceleration checks' cases: {0}")]
    Cases(String),
    #[error("the acceleration checks' cases answered what is not their report: {0}")]
    CasesOutput(#[source] serde_json::Error),
    #[error("the acceleration checks' scratch pod: {0}")]
    ScratchPod(#[source] crate::config::ConfigError),
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> CheckError {
    move |source| CheckError::Io { what, source }
}

/// A network namespace of its own, alive while its fd is open.
fn scratch_netns() -> io::Result<File> {
    std::thread::spawn(|| {
        // SAFETY: unshare affects only this short-lived thread.
        if unsafe { libc::unshare(libc::CLONE_NEWNET) } != 0 {
            return Err(io::Error::last_os_error());
        }
        File::open("/proc/thread-self/ns/net")
    })
    .join()
    .map_err(|_| io::Error::other("the netns thread panicked"))?
}

/// Runs every case once in the scratch pod (its config as the node's maps hold it now).
fn run_cases(
    netns: &File,
    cgroup: &Path,
) -> Result<BTreeMap<String, Result<Observation, String>>, CheckError> {
    let join = std::sync::Arc::new(
        CgroupJoin::new(cgroup).map_err(io_err("preparing to join the scratch cgroup"))?,
    );
    let join_in_child = std::sync::Arc::clone(&join);
    let netns_fd = netns.as_raw_fd();
    let mut cmd = Command::new(std::env::current_exe().map_err(io_err("finding this binary"))?);
    cmd.args(["accel-cases", "--destination", DESTINATION])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    // SAFETY: between fork and exec the child makes only raw system calls on fds the parent
    // keeps open.
    unsafe {
        cmd.pre_exec(move || {
            // Dies with the checker: an agent killed mid-check leaves no cases running.
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                return Err(io::Error::last_os_error());
            }
            join_in_child
                .join_from_child()
                .map_err(io::Error::from_raw_os_error)?;
            if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
    // The child's steps and exec fail alike here; a move refused by the cgroup namespace looks
    // like ENOENT, so that error also says what the move needs.
    let child = cmd.spawn().map_err(|e| CheckError::Io {
        what: "starting the cases (joining the scratch cgroup and netns, then exec)",
        source: match e.raw_os_error() {
            Some(errno) if errno == libc::ENOENT => io::Error::other(join.explain(errno)),
            _ => e,
        },
    })?;
    let out = wait_with_timeout(child, Duration::from_mins(10))?;
    if !out.status.success() {
        return Err(CheckError::Cases(format!(
            "the cases' process failed: {}",
            out.status
        )));
    }
    serde_json::from_slice(&out.stdout).map_err(CheckError::CasesOutput)
}

fn wait_with_timeout(
    mut child: std::process::Child,
    limit: Duration,
) -> Result<std::process::Output, CheckError> {
    let started = std::time::Instant::now();
    let stdout = child.stdout.take();
    let reader = std::thread::spawn(move || {
        let mut buf = Vec::new();
        if let Some(mut s) = stdout {
            let _ = io::Read::read_to_end(&mut s, &mut buf);
        }
        buf
    });
    let status = loop {
        if let Some(status) = child.try_wait().map_err(io_err("waiting for the cases"))? {
            break status;
        }
        if started.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            return Err(CheckError::Cases(format!(
                "the cases took longer than {limit:?}"
            )));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    Ok(std::process::Output {
        status,
        stdout: reader.join().unwrap_or_default(),
        stderr: Vec::new(),
    })
}

/// Where a running check names its scratch pod, so that the agent's sweep of attaches that died
/// half-way leaves it alone (it has no record).
fn marker(paths: &Paths) -> std::path::PathBuf {
    paths.state_dir.join("accel-check.json")
}

/// The netns cookie of the scratch pod of a check that is running now, if any.
#[must_use]
pub fn running_scratch_pod(paths: &Paths) -> Option<u64> {
    let marker: serde_json::Value =
        serde_json::from_slice(&std::fs::read(marker(paths)).ok()?).ok()?;
    let pid = i32::try_from(marker["pid"].as_u64()?).ok()?;
    // SAFETY: signal 0 only asks whether the process exists.
    let alive = unsafe { libc::kill(pid, 0) } == 0;
    alive.then(|| marker["netns_cookie"].as_u64()).flatten()
}

fn lock(paths: &Paths) -> Result<crate::lock::NodeLock, CheckError> {
    crate::lock::NodeLock::acquire(&paths.lock_path()).map_err(io_err("taking the node lock"))
}

/// Runs the checks in a scratch pod. The node lock is held only while the scratch pod is attached,
/// switched and detached, so CNI ADDs go on meanwhile.
pub fn run(paths: &Paths, sizing: crate::ebpf::sizing::NodeSizing) -> Result<Report, CheckError> {
    let netns = scratch_netns().map_err(io_err("creating a scratch netns"))?;
    let netns_path = format!("/proc/self/fd/{}", netns.as_raw_fd());
    let netns_cookie = crate::netns::Netns::open(Path::new(&netns_path))
        .and_then(|n| n.cookie(crate::ebpf::netns_cookie::netns_cookie))
        .map_err(|e| CheckError::Io {
            what: "the scratch netns's cookie",
            source: io::Error::other(e.to_string()),
        })?;
    let scratch =
        ScratchCgroup::create("accel-check").map_err(io_err("creating a scratch cgroup"))?;
    let cgroup = File::open(&scratch.path).map_err(io_err("opening the scratch cgroup"))?;
    let plain = CaptureConfig::from_pod(&PodSpec {
        pod_ips: vec![SCRATCH_POD_IP.into()],
        ..PodSpec::default()
    })
    .map_err(CheckError::ScratchPod)?;
    let accelerated = CaptureConfig {
        accelerate: true,
        ..plain.clone()
    };
    let target = PodTarget::new(
        netns_cookie,
        (Path::new(&netns_path), &netns),
        (&scratch.path, &cgroup),
    );
    let marker_json =
        serde_json::json!({ "pid": std::process::id(), "netns_cookie": netns_cookie });
    let mut ebpf = {
        let _lock = lock(paths)?;
        let mut ebpf = EbpfBackend::open(paths, sizing)?;
        crate::fsutil::write_atomic(&marker(paths), marker_json.to_string().as_bytes(), None)
            .map_err(io_err("writing the check's marker"))?;
        ebpf.attach(&target, &plain)?;
        ebpf
    };
    let runs = run_cases(&netns, &scratch.path).and_then(|plain_run| {
        {
            let _lock = lock(paths)?;
            ebpf.reconfigure(netns_cookie, &accelerated)?;
        }
        let accel_run = run_cases(&netns, &scratch.path)?;
        let bytes = ebpf
            .accel_counters(netns_cookie)
            .map_or(0, |c| c.accelerated_bytes);
        Ok((plain_run, accel_run, bytes))
    });
    {
        let _lock = lock(paths);
        ebpf.detach(netns_cookie);
        let _ = std::fs::remove_file(marker(paths));
    }
    let (plain_run, mut accel_run, accelerated_bytes) = runs?;
    let cases: Vec<CaseResult> = plain_run
        .into_iter()
        .map(|(name, plain)| {
            let accelerated = accel_run
                .remove(&name)
                .unwrap_or_else(|| Err("did not run".into()));
            CaseResult {
                passed: plain.is_ok() && plain == accelerated,
                name,
                plain,
                accelerated,
            }
        })
        .collect();
    let passed = accelerated_bytes > 0 && cases.iter().all(|c| c.passed);
    Ok(Report {
        kernel: super::kernel_release(),
        build: crate::ebpf::loader::build_name(),
        cases,
        accelerated_bytes,
        passed,
    })
}

/// The child's side: runs every case in the pod it was put in and prints the answers as JSON.
pub fn run_cases_here(destination: std::net::SocketAddr) -> anyhow::Result<()> {
    crate::netns::set_loopback_up()?;
    let listener = std::net::TcpListener::bind(("0.0.0.0", crate::config::OUTBOUND_PORT))?;
    let pair = super::cases::Pair {
        listener: &listener,
        destination,
    };
    let answers: BTreeMap<&str, Result<Observation, String>> = super::cases::CASES
        .iter()
        .map(|(name, case)| {
            (
                *name,
                case(&pair).map_err(|e| format!("{:?}: {e}", e.kind())),
            )
        })
        .collect();
    println!("{}", serde_json::to_string(&answers)?);
    Ok(())
}
