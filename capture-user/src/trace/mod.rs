//! `capture trace`: the decisions the kernel programs take for one pod, live.
//!
//! A session leases one of the node's trace slots for the pod (`capture_common::trace`): the
//! lease names its ring buffer, its rate limit and its expiry, and the gate tells the programs
//! that some pod is traced. The session renews the lease every second and removes it when it
//! ends; a session killed outright leaves a lease that expires within seconds (the programs stop
//! emitting), and the next session or the agent removes it. Claims are serialised by a lock file
//! of their own, so the agent's node lock is never waited for.

pub mod event;

use std::{
    os::fd::AsFd as _,
    sync::atomic::{AtomicBool, Ordering},
    time::{Duration, Instant},
};

use aya::maps::{MapData, RingBuf};
use capture_common::trace::{TraceEvent, TraceLease, TRACE_LEASE_NS, TRACE_SLOTS};
use serde::Serialize;

use self::event::{decode, monotonic_to_unix, Filter, Line};
use crate::{
    ebpf::{loader::LoadError, trace_maps::TraceMaps},
    explain::{find_pod, ExplainError},
    lock::NodeLock,
    paths::Paths,
    record::{Mode, PodRecord, PodSelector},
};

/// Events a traced pod may emit per second unless `--rate` says otherwise.
pub const DEFAULT_RATE: u32 = 1000;

#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    #[error(transparent)]
    Pod(#[from] ExplainError),
    #[error("pod {pod} runs on the {mode} backend, whose decisions are netfilter's: `capture explain` names the rule for a connection; for a live trace use netfilter's tracing in the pod's netns (iptables: `iptables -t raw -I OUTPUT -j TRACE` and `xtables-monitor --trace`; nftables: a rule `meta nftrace set 1` in an output chain of a table of your own, and `nft monitor trace`)")]
    IptablesPod { pod: String, mode: Mode },
    #[error("the node's programs cannot be traced ({0}); `capture status` shows the node's build, and a build with `capture trace` must run it")]
    Maps(#[from] LoadError),
    #[error("pod {pod} is traced already by process {pid} (its lease ends within {secs} s); stop that session first")]
    AlreadyTraced { pod: String, pid: u32, secs: u64 },
    #[error(
        "{slots} pods are traced on this node already ({pods}); stop one of those sessions first"
    )]
    NoSlot { slots: u32, pods: String },
    #[error("{what}: {source}")]
    Io {
        what: String,
        source: std::io::Error,
    },
    #[error("{what}: {source}")]
    Map {
        what: &'static str,
        source: aya::maps::MapError,
    },
}

/// What to trace and how.
pub struct TraceRequest {
    pub pod: PodSelector,
    pub json: bool,
    pub duration: Option<Duration>,
    pub filter: Filter,
    pub rate: u32,
}

/// How a session ended, for its last line.
#[derive(Debug, Default, Serialize)]
pub struct Summary {
    pub events: u64,
    pub shown: u64,
    /// Events the pod's rate limit or a full ring buffer dropped.
    pub dropped: u64,
}

/// `CLOCK_MONOTONIC` now, the programs' `bpf_ktime_get_ns` clock.
fn monotonic_ns() -> u64 {
    nix::time::clock_gettime(nix::time::ClockId::CLOCK_MONOTONIC).map_or(0, |t| {
        u64::try_from(t.tv_sec()).unwrap_or(0) * 1_000_000_000
            + u64::try_from(t.tv_nsec()).unwrap_or(0)
    })
}

fn pid_alive(pid: u32) -> bool {
    std::path::Path::new(&format!("/proc/{pid}")).exists()
}

/// A lease is live until it expires: its session renews it every second. (Its process id
/// alone cannot say: the session may run in another pid namespace.)
fn lease_is_live(lease: &TraceLease, now: u64) -> bool {
    lease.expires_ns > now
}

fn lock(paths: &Paths) -> Result<NodeLock, TraceError> {
    let path = paths.trace_lock_path();
    NodeLock::acquire(&path).map_err(|source| TraceError::Io {
        what: format!("locking {}", path.display()),
        source,
    })
}

/// Removes the leases whose session is gone (expired) and sets the gate to the leases left;
/// returns how many it removed. The caller holds the trace lock.
fn clear_dead(maps: &mut TraceMaps) -> Result<usize, TraceError> {
    let now = monotonic_ns();
    let dead: Vec<u64> = maps
        .leases
        .iter()
        .flatten()
        .filter(|(_, lease)| !lease_is_live(lease, now))
        .map(|(cookie, _)| cookie)
        .collect();
    for cookie in &dead {
        let _ = maps.leases.remove(cookie);
    }
    set_gate(maps)?;
    Ok(dead.len())
}

fn set_gate(maps: &mut TraceMaps) -> Result<(), TraceError> {
    let traced = u32::try_from(maps.leases.keys().flatten().count()).unwrap_or(u32::MAX);
    maps.gate
        .set(0, traced, 0)
        .map_err(|source| TraceError::Map {
            what: "writing TRACE_GATE",
            source,
        })
}

/// Removes the leases of sessions that are gone; for the agent's periodic sweep. Nothing to do
/// (and no error) on a node without programs or without tracing.
pub fn sweep(paths: &Paths) -> usize {
    let Ok(mut maps) = TraceMaps::open(paths) else {
        return 0;
    };
    let Ok(_lock) = lock(paths) else {
        return 0;
    };
    clear_dead(&mut maps).unwrap_or(0)
}

/// Tracing on the node: pods traced now, and the events the programs emitted and dropped since
/// they were loaded.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct NodeTrace {
    pub traced_pods: u32,
    pub emitted: u64,
    pub dropped: u64,
    /// The leases: who traces which pod (a dead session's stays until it is cleared).
    pub sessions: Vec<TraceSession>,
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TraceSession {
    pub netns_cookie: u64,
    pub pid: u32,
    pub slot: u32,
    pub dropped: u64,
}

/// `None` on a node without programs, or whose programs predate tracing.
#[must_use]
pub fn node_trace(paths: &Paths) -> Option<NodeTrace> {
    let maps = TraceMaps::open(paths).ok()?;
    let (emitted, dropped) = maps.totals();
    Some(NodeTrace {
        traced_pods: maps.gate.get(&0, 0).unwrap_or(0),
        emitted,
        dropped,
        sessions: maps
            .leases
            .iter()
            .flatten()
            .map(|(netns_cookie, lease)| TraceSession {
                netns_cookie,
                pid: lease.owner_pid,
                slot: lease.slot,
                dropped: lease.dropped,
            })
            .collect(),
    })
}

/// Leases a slot for `record`'s pod and returns it.
fn claim(
    maps: &mut TraceMaps,
    record: &PodRecord,
    pod: &str,
    rate: u32,
) -> Result<u32, TraceError> {
    let now = monotonic_ns();
    let leases: Vec<(u64, TraceLease)> = maps.leases.iter().flatten().collect();
    if let Some((_, lease)) = leases.iter().find(|(c, _)| *c == record.netns_cookie) {
        return Err(TraceError::AlreadyTraced {
            pod: pod.to_string(),
            pid: lease.owner_pid,
            secs: lease.expires_ns.saturating_sub(now).div_ceil(1_000_000_000),
        });
    }
    let slot = (0..TRACE_SLOTS)
        .find(|s| leases.iter().all(|(_, l)| l.slot != *s))
        .ok_or_else(|| TraceError::NoSlot {
            slots: TRACE_SLOTS,
            pods: leases
                .iter()
                .map(|(c, l)| format!("netns cookie {c}, process {}", l.owner_pid))
                .collect::<Vec<_>>()
                .join("; "),
        })?;
    let lease = TraceLease {
        expires_ns: now + TRACE_LEASE_NS,
        window_start_ns: 0,
        dropped: 0,
        emitted: 0,
        owner_pid: std::process::id(),
        slot,
        events_per_second: rate,
        window_events: 0,
    };
    maps.leases
        .insert(record.netns_cookie, lease, 0)
        .map_err(|source| TraceError::Map {
            what: "writing TRACE_PODS",
            source,
        })?;
    set_gate(maps)?;
    Ok(slot)
}

/// Claims a slot; a lease left by a session whose process is gone (killed) is waited out, at
/// most one lease long, since it is not renewed any more.
fn claim_when_free(
    paths: &Paths,
    maps: &mut TraceMaps,
    record: &PodRecord,
    pod: &str,
    rate: u32,
) -> Result<u32, TraceError> {
    let deadline = Instant::now() + Duration::from_nanos(TRACE_LEASE_NS) + Duration::from_secs(1);
    let mut told = false;
    loop {
        let claimed = {
            let _lock = lock(paths)?;
            let cleared = clear_dead(maps)?;
            if cleared > 0 {
                tracing::info!(cleared, "removed trace leases of sessions that are gone");
            }
            claim(maps, record, pod, rate)
        };
        match claimed {
            Err(TraceError::AlreadyTraced { pid, .. })
                if !pid_alive(pid) && Instant::now() < deadline =>
            {
                if !told {
                    eprintln!("trace: waiting for the lease of a session that is gone (process {pid}) to expire");
                    told = true;
                }
                std::thread::sleep(Duration::from_millis(250));
            }
            other => return other,
        }
    }
}

/// Set by SIGINT and SIGTERM: the session ends and removes its lease.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: i32) {
    STOP.store(true, Ordering::Relaxed);
}

fn stop_on_signals() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    for sig in [Signal::SIGINT, Signal::SIGTERM, Signal::SIGPIPE] {
        // SAFETY: the handler only stores to an atomic.
        let _ = unsafe { signal(sig, SigHandler::Handler(on_signal)) };
    }
}

/// Reads every event waiting in `ring`.
fn drain(ring: &mut RingBuf<MapData>, mut each: impl FnMut(&TraceEvent)) {
    while let Some(item) = ring.next() {
        if item.len() >= size_of::<TraceEvent>() {
            // SAFETY: the programs write whole `TraceEvent`s; read unaligned to be safe.
            let event = unsafe { std::ptr::read_unaligned(item.as_ptr().cast::<TraceEvent>()) };
            each(&event);
        }
    }
}

/// Runs a session until `duration` passes, a signal comes, or `out` fails (a closed pipe).
///
/// # Errors
/// An unknown or iptables pod, a node without tracing, a pod traced already, no free slot.
pub fn run(
    paths: &Paths,
    req: &TraceRequest,
    out: &mut dyn std::io::Write,
) -> Result<Summary, TraceError> {
    let record = find_pod(paths, &req.pod)?;
    let pod = record.display_name();
    if record.mode != Mode::Ebpf {
        return Err(TraceError::IptablesPod {
            pod,
            mode: record.mode,
        });
    }
    let mut maps = TraceMaps::open(paths)?;
    let slot = claim_when_free(paths, &mut maps, &record, &pod, req.rate)?;
    stop_on_signals();
    let result = follow(&mut maps, &record, slot, req, out);
    // The lease goes whatever happened while following.
    let _lock = lock(paths)?;
    let lease = maps.leases.get(&record.netns_cookie, 0).ok();
    let _ = maps.leases.remove(&record.netns_cookie);
    set_gate(&mut maps)?;
    let mut summary = result?;
    summary.dropped = lease.map_or(summary.dropped, |l| l.dropped);
    Ok(summary)
}

fn follow(
    maps: &mut TraceMaps,
    record: &PodRecord,
    slot: u32,
    req: &TraceRequest,
    out: &mut dyn std::io::Write,
) -> Result<Summary, TraceError> {
    let mut ring = maps.ring(slot)?;
    // What a killed session of this slot left unread is not this pod's.
    drain(&mut ring, |_| {});
    let started = Instant::now();
    let mut renewed = Instant::now();
    let offset = monotonic_to_unix();
    let mut summary = Summary::default();
    let mut lines: Vec<Line> = Vec::new();
    while !STOP.load(Ordering::Relaxed) && req.duration.is_none_or(|d| started.elapsed() < d) {
        let mut fds = [nix::poll::PollFd::new(
            ring.as_fd(),
            nix::poll::PollFlags::POLLIN,
        )];
        let _ = nix::poll::poll(&mut fds, nix::poll::PollTimeout::from(200u16));
        drain(&mut ring, |event| lines.push(decode(event, offset)));
        for line in lines.drain(..) {
            summary.events += 1;
            if !req.filter.matches(&line) {
                continue;
            }
            summary.shown += 1;
            let text = if req.json {
                serde_json::to_string(&line).expect("serialisable")
            } else {
                line.render()
            };
            if writeln!(out, "{text}").and_then(|()| out.flush()).is_err() {
                return Ok(summary);
            }
        }
        if renewed.elapsed() >= Duration::from_secs(1) {
            let dropped = renew(maps, record.netns_cookie)?;
            if dropped > summary.dropped {
                eprintln!(
                    "trace: {} decisions dropped so far (over --rate {} per second, or a full buffer)",
                    dropped, req.rate
                );
                summary.dropped = dropped;
            }
            renewed = Instant::now();
        }
    }
    Ok(summary)
}

/// Moves the lease's expiry on (the programs' counters in it are kept as read); returns the
/// events dropped so far.
fn renew(maps: &mut TraceMaps, cookie: u64) -> Result<u64, TraceError> {
    let Ok(mut lease) = maps.leases.get(&cookie, 0) else {
        return Ok(0);
    };
    lease.expires_ns = monotonic_ns() + TRACE_LEASE_NS;
    maps.leases
        .insert(cookie, lease, 0)
        .map_err(|source| TraceError::Map {
            what: "renewing the trace lease",
            source,
        })?;
    Ok(lease.dropped)
}
