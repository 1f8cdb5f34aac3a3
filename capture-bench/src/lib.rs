//! `cargo xtask bench`: capture's cost against the iptables path and against no capture at all,
//! measured side by side, interleaved, in rounds, on this machine.
//!
//! Each mode gets its own pod (netns + cgroup) wired to a remote netns; the same proxy and the
//! same load generator run in every mode. The limit (`none`) has no capture: the client dials
//! the proxy's listener directly. `--real-proxy` (`real_proxy.rs`) runs HAProxy as the sidecar
//! instead, end to end.

mod bed;
pub mod cni_add;
mod cpus;
pub mod identity_cost;
pub mod node_scale;
pub mod real_proxy;
pub mod reconcile_cost;
pub mod report;
pub mod roles;
mod schedule;
mod stats;
mod targets;
pub mod trace_cost;

use std::{
    path::PathBuf,
    time::{Duration, Instant},
};

use capture_tests::topology::Topology;
use serde::{Deserialize, Serialize};

use self::{
    bed::Bed,
    roles::{LoadResult, Workload},
    schedule::Schedule,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No capture: the client dials the proxy directly (the limit).
    None,
    Iptables,
    /// The same rules as native nftables tables.
    Nftables,
    Ebpf,
    /// ebpf with the app-to-proxy acceleration (`sk_msg`) on, whatever this kernel's checks found:
    /// the report says which differences were accepted for the measurement.
    EbpfAccel,
    /// ebpf whose programs were loaded without tracing (`CAPTURE_WITHOUT_TRACE=1`: the verifier
    /// prunes the trace code). Only when asked for (`--modes`), beside `ebpf`.
    EbpfNotrace,
    /// ebpf with `capture trace` reading the pod's decisions the whole time. Only when asked for.
    EbpfTrace,
    /// ebpf with proxy identity by container: the proxy in a container cgroup of its own, which
    /// alone is exempt. In every full run, and beside `ebpf` alone in the identity-cost run.
    EbpfIdentity,
}

impl Mode {
    /// The modes of a run that names none.
    pub const ALL: [Self; 6] = [
        Self::None,
        Self::Iptables,
        Self::Nftables,
        Self::Ebpf,
        Self::EbpfAccel,
        Self::EbpfIdentity,
    ];
    /// What tracing costs: the programs without it, with it off, with it on.
    pub const TRACE_COST: [Self; 3] = [Self::EbpfNotrace, Self::Ebpf, Self::EbpfTrace];
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Iptables => "iptables",
            Self::Nftables => "nftables",
            Self::Ebpf => "ebpf",
            Self::EbpfAccel => "ebpf+accel",
            Self::EbpfNotrace => "ebpf-notrace",
            Self::EbpfTrace => "ebpf+trace",
            Self::EbpfIdentity => "ebpf+identity",
        }
    }
}

/// The network settings of the pods under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Settings {
    /// The kernel's defaults, as nodes run them (`tcp_tw_reuse=2`: `TIME_WAIT` ports are reused
    /// for loopback connections only).
    Default,
    /// Tuned for connection churn: `tcp_tw_reuse=1` and ports 1024-65000, so that no mode runs out
    /// of ephemeral ports in `TIME_WAIT`.
    Tuned,
}

impl Settings {
    const TUNED_SYSCTLS: [&'static str; 2] = [
        "net.ipv4.tcp_tw_reuse=1",
        "net.ipv4.ip_local_port_range=1024 65000",
    ];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Proxy {
    /// A minimal echo listener: the cost of capture itself.
    Echo,
    /// Reads `SO_ORIGINAL_DST` and connects upstream (Envoy's outbound shape).
    Forward,
    /// Debian's HAProxy forwarding to each connection's original destination (`real_proxy.rs`).
    /// Beside it `none` means no mesh at all: no proxy runs and the app dials the upstream.
    Haproxy,
}

impl Proxy {
    fn label(self) -> &'static str {
        match self {
            Self::Echo => "echo proxy",
            Self::Forward => "forward proxy",
            Self::Haproxy => "haproxy",
        }
    }
}

/// The address family of a cell's connections, and the pod's addresses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Family {
    /// IPv4, in a dual-stack pod (every cell of the runs before IPv6 was measured).
    #[default]
    Ipv4,
    /// IPv6, in a dual-stack pod.
    Ipv6,
    /// IPv6, in a pod with an IPv6 address alone.
    Ipv6Only,
}

impl Family {
    fn label(self) -> &'static str {
        match self {
            Self::Ipv4 => "",
            Self::Ipv6 => ", IPv6",
            Self::Ipv6Only => ", IPv6-only pod",
        }
    }
}

#[derive(Clone, Copy, Debug, Serialize, Deserialize)]
pub struct Cell {
    pub workload: Workload,
    pub concurrency: usize,
    pub inbound: bool,
    pub proxy: Proxy,
    pub settings: Settings,
    #[serde(default)]
    pub family: Family,
}

impl Cell {
    #[must_use]
    pub fn label(&self) -> String {
        let w = match self.workload {
            Workload::Crr => "connect+rr+close",
            Workload::Rr => "persistent rr",
            Workload::Stream => "stream",
        };
        let dir = if self.inbound { "inbound" } else { "outbound" };
        let tuned = match self.settings {
            Settings::Default => "",
            Settings::Tuned => ", tuned",
        };
        format!(
            "{dir} {w} c{} ({}{tuned}{})",
            self.concurrency,
            self.proxy.label(),
            self.family.label()
        )
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Sample {
    pub round: usize,
    pub mode: Mode,
    pub load: LoadResult,
    /// CPU time of the whole machine per operation, microseconds (from /proc/stat).
    pub cpu_us_per_op: f64,
    /// CPU time of the pod's processes (the app and its proxy) per operation, microseconds, from
    /// the pod's cgroup: unlike the machine's, other work on the machine does not count. 0 in
    /// runs from before it was measured.
    #[serde(default)]
    pub pod_cpu_us_per_op: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct CellResult {
    pub cell: Cell,
    pub label: String,
    pub samples: Vec<Sample>,
    /// After the cell's last round, per mode: what the pod's netns held.
    pub aftermath: Vec<(Mode, Aftermath)>,
}

impl CellResult {
    /// A cell before its first sample.
    #[must_use]
    pub fn new(cell: Cell) -> Self {
        Self {
            cell,
            label: cell.label(),
            samples: Vec::new(),
            aftermath: Vec::new(),
        }
    }
}

/// This machine's kernel release, as the reports state it.
#[must_use]
pub fn kernel_release() -> String {
    nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default()
}

/// What connection churn leaves in a pod's netns.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct Aftermath {
    /// Sockets in `TIME_WAIT` (each holds its 4-tuple, and its local port unless reused).
    pub time_wait: u64,
    /// Conntrack entries (iptables' REDIRECT needs one per connection).
    pub conntrack: u64,
}

/// What this kernel's acceleration checks found, accepted for the ebpf+accel measurement.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AccelNote {
    pub differences: Vec<String>,
    pub cases: usize,
}

#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct AttachScale {
    pub mode: String,
    pub pods: usize,
    /// Attach latency in milliseconds, in attach order.
    pub latencies_ms: Vec<f64>,
    /// Unreclaimable kernel memory added per attached pod after the first, KiB.
    pub kib_per_pod: f64,
}

/// In-kernel cost of one capture program in the profiling pass (`kernel.bpf_stats_enabled`).
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ProgramCost {
    pub program: String,
    pub runs: u64,
    pub ns_per_run: f64,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct Results {
    pub kernel: String,
    pub cpus: usize,
    pub quick: bool,
    pub rounds: usize,
    pub seconds_per_sample: f64,
    /// Whether one-client runs kept their processes on one CPU (cpus.rs); runs from before it
    /// did not.
    #[serde(default)]
    pub one_client_on_one_cpu: bool,
    pub cells: Vec<CellResult>,
    /// Conntrack entries in each mode's pod netns after the runs.
    pub conntrack_entries: Vec<(Mode, u64)>,
    pub attach: Vec<AttachScale>,
    /// capture-cni ADD through the agent, per backend.
    pub cni_add: Vec<cni_add::CniAdd>,
    /// Where the ebpf backend's kernel time goes: a separate connect+rr+close pass (echo proxy).
    pub program_costs: Vec<ProgramCost>,
    /// Connections made in that pass.
    pub profiled_connections: u64,
    pub accel: AccelNote,
    /// Where the ebpf+accel path's kernel time goes: a persistent request/response pass.
    pub accel_program_costs: Vec<ProgramCost>,
    /// Requests answered in that pass.
    pub accel_profiled_requests: u64,
}

pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// Only the workloads whose label contains this (e.g. `connect+rr+close c1 (echo`), and no
    /// attach or CNI measurements: a focused run while working on one number.
    pub focus: Option<String>,
    /// Only these modes; all when empty.
    pub modes: Vec<Mode>,
    /// Rounds instead of the default (5, quick 3).
    pub rounds: Option<usize>,
    /// One-client runs too on every CPU, left to the scheduler (by default they run on one CPU:
    /// cpus.rs).
    pub any_cpu: bool,
}

/// Every workload under the kernel's defaults (the headline), connection churn again under
/// tuned settings, and IPv6 connection churn in a dual-stack pod and in an IPv6-only one.
fn cells(concurrency: usize) -> Vec<Cell> {
    let c = |workload, concurrency, inbound, proxy, settings| Cell {
        workload,
        concurrency,
        inbound,
        proxy,
        settings,
        family: Family::Ipv4,
    };
    let mut out = Vec::new();
    for proxy in [Proxy::Echo, Proxy::Forward] {
        out.push(c(Workload::Crr, 1, false, proxy, Settings::Default));
        out.push(c(
            Workload::Crr,
            concurrency,
            false,
            proxy,
            Settings::Default,
        ));
        out.push(c(Workload::Rr, 1, false, proxy, Settings::Default));
        out.push(c(Workload::Stream, 1, false, proxy, Settings::Default));
        if proxy == Proxy::Echo {
            out.push(c(Workload::Crr, 1, true, proxy, Settings::Default));
        }
        out.push(c(Workload::Crr, 1, false, proxy, Settings::Tuned));
        out.push(c(Workload::Crr, concurrency, false, proxy, Settings::Tuned));
    }
    for family in [Family::Ipv6, Family::Ipv6Only] {
        for clients in [1, concurrency] {
            out.push(Cell {
                family,
                ..c(
                    Workload::Crr,
                    clients,
                    false,
                    Proxy::Echo,
                    Settings::Default,
                )
            });
        }
    }
    out
}

/// Runs this kernel's acceleration checks once (in a throwaway node) and notes their differences,
/// which the ebpf+accel pods then accept: the measurement shows what acceleration would give,
/// the note what it would cost in correctness here.
fn check_acceleration() -> AccelNote {
    let topo = Topology::new();
    let out = topo.capture(&["accel-check", "--json"]);
    let report: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("accel-check report ({e}): {out:?}"));
    let cases = report["cases"].as_array().cloned().unwrap_or_default();
    AccelNote {
        differences: cases
            .iter()
            .filter(|c| c["passed"] == false)
            .filter_map(|c| c["name"].as_str().map(String::from))
            .collect(),
        cases: cases.len(),
    }
}

/// Unreclaimable kernel memory, KiB: where BPF links, program arrays and map entries live
/// (kmalloc, per-cpu and vmalloc allocations). Page cache and reclaimable slab are left out.
pub(crate) fn kernel_memory_kib() -> u64 {
    let meminfo = std::fs::read_to_string("/proc/meminfo").unwrap_or_default();
    ["SUnreclaim:", "Percpu:", "VmallocUsed:"]
        .iter()
        .filter_map(|field| {
            meminfo
                .lines()
                .find_map(|l| l.strip_prefix(field))
                .and_then(|v| v.split_whitespace().next()?.parse::<u64>().ok())
        })
        .sum()
}

/// Attach latency and kernel memory as the node fills up with pods.
fn attach_scale(mode: Mode, pods: usize) -> AttachScale {
    let first = Topology::new();
    let mut topos = vec![first];
    for _ in 1..pods {
        topos.push(Topology::with_dirs(topos[0].dirs.shared()));
    }
    let mut latencies_ms = Vec::with_capacity(pods);
    // The first pod pays the node's one-time cost (loading the programs, creating the maps);
    // memory per pod is measured over the pods after it.
    let mut before = 0;
    for (i, t) in topos.iter().enumerate() {
        let start = Instant::now();
        t.attach(&["--mode", mode.name(), "--max-pods", &pods.to_string()]);
        latencies_ms.push(start.elapsed().as_secs_f64() * 1e3);
        if i == 0 {
            before = kernel_memory_kib();
        }
    }
    let after = kernel_memory_kib();
    AttachScale {
        mode: mode.name().into(),
        pods,
        latencies_ms,
        kib_per_pod: after.saturating_sub(before) as f64 / (pods.max(2) - 1) as f64,
    }
}

/// Attach latency and memory as pods fill a node (iptables and nftables to at most 200 pods), and
/// the CNI ADD through capture-cni and the agent.
fn control_plane(pods: usize, cni_pods: usize) -> (Vec<AttachScale>, Vec<cni_add::CniAdd>) {
    eprintln!("bench: attaching {pods} pods per backend");
    let attach = [Mode::Ebpf, Mode::Iptables, Mode::Nftables]
        .iter()
        .map(|m| {
            attach_scale(
                *m,
                if *m == Mode::Ebpf {
                    pods
                } else {
                    pods.min(200)
                },
            )
        })
        .collect();
    eprintln!(
        "bench: CNI ADD of {cni_pods} pods per backend through capture-cni and the agent, one at a time and {} at once",
        cni_add::BURST
    );
    let cni_add = cni_add::measure(
        &cni_add::MODES.map(String::from),
        cni_pods,
        &[1, cni_add::BURST],
        cni_add::ROUNDS,
    );
    (attach, cni_add)
}

/// Runs the whole benchmark and writes results.json, benchmarks.md and the chart.
#[expect(
    clippy::too_many_lines,
    reason = "the benchmark's schedule, read top to bottom in the order it runs"
)]
pub fn run(opts: &Options) -> Results {
    capture_tests::require_root();
    let (rounds, seconds, concurrency, pods) = if opts.quick {
        (3, 0.6, 8, 40)
    } else {
        (5, 3.0, 8, 1000)
    };
    let rounds = opts.rounds.unwrap_or(rounds);
    let warmup = Duration::from_millis(if opts.quick { 150 } else { 500 });
    let duration = Duration::from_secs_f64(seconds);
    let cells: Vec<Cell> = cells(concurrency)
        .into_iter()
        .filter(|c| {
            opts.focus
                .as_ref()
                .is_none_or(|f| c.label().contains(f.as_str()))
        })
        .collect();
    let modes: Vec<Mode> = if opts.modes.is_empty() {
        Mode::ALL.to_vec()
    } else {
        opts.modes.clone()
    };
    let mut results: Vec<CellResult> = cells.iter().copied().map(CellResult::new).collect();
    let mut conntrack = Vec::new();
    let mut profile = (Vec::new(), 0);
    let mut accel_profile = (Vec::new(), 0);
    let accel = if modes.contains(&Mode::EbpfAccel) {
        eprintln!("bench: running the acceleration checks");
        check_acceleration()
    } else {
        AccelNote::default()
    };
    // Dual-stack pods serve the IPv4 and IPv6 cells; IPv6-only ones get beds of their own.
    for (proxy, settings, ipv6_only) in [
        (Proxy::Echo, Settings::Default, false),
        (Proxy::Echo, Settings::Default, true),
        (Proxy::Echo, Settings::Tuned, false),
        (Proxy::Forward, Settings::Default, false),
        (Proxy::Forward, Settings::Tuned, false),
    ] {
        let ours = |c: &Cell| {
            c.proxy == proxy
                && c.settings == settings
                && (c.family == Family::Ipv6Only) == ipv6_only
        };
        if !cells.iter().any(ours) {
            continue;
        }
        eprintln!(
            "bench: setting up the {proxy:?} proxy ({settings:?} settings{}) in a pod per mode",
            if ipv6_only { ", IPv6-only pods" } else { "" }
        );
        let beds: Vec<Bed> = modes
            .iter()
            .map(|m| Bed::new(*m, proxy, settings, ipv6_only, &accel))
            .collect();
        let schedule = Schedule {
            rounds,
            warmup,
            duration,
            one_cpu_for_one_client: !opts.any_cpu,
            fresh_upstream_per_sample: false,
        };
        schedule.measure(&beds, &cells, &mut results, ours);
        if proxy == Proxy::Echo && settings == Settings::Default && !ipv6_only {
            conntrack = beds
                .iter()
                .map(|b| (b.mode, b.conntrack_entries()))
                .collect();
            let profiled = cells
                .iter()
                .find(|c| c.proxy == proxy && c.workload == Workload::Crr && !c.inbound);
            if let (Some(bed), Some(cell)) = (beds.iter().find(|b| b.mode == Mode::Ebpf), profiled)
            {
                eprintln!("bench: profiling the ebpf programs on {}", cell.label());
                profile = bed.profile(cell, duration);
            }
            let rr = cells.iter().find(|c| ours(c) && c.workload == Workload::Rr);
            if let (Some(bed), Some(cell)) = (beds.iter().find(|b| b.mode == Mode::EbpfAccel), rr) {
                eprintln!(
                    "bench: profiling the ebpf+accel programs on {}",
                    cell.label()
                );
                accel_profile = bed.profile(cell, duration);
            }
        }
    }
    let mut results = Results {
        kernel: kernel_release(),
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        quick: opts.quick,
        rounds,
        seconds_per_sample: seconds,
        one_client_on_one_cpu: !opts.any_cpu && cpus::Cpus::allowed().last_alone().is_some(),
        cells: results,
        conntrack_entries: conntrack,
        attach: Vec::new(),
        cni_add: Vec::new(),
        program_costs: profile.0,
        profiled_connections: profile.1,
        accel,
        accel_program_costs: accel_profile.0,
        accel_profiled_requests: accel_profile.1,
    };
    if opts.focus.is_none() {
        // The data path's figures are written before the control plane is measured, so that
        // a failure there loses the half hour before it.
        report::write(&results, &opts.out);
        (results.attach, results.cni_add) = control_plane(pods, if opts.quick { 10 } else { 100 });
    }
    if identity_cost::is_identity_cost(&results) {
        identity_cost::write(&results, &opts.out);
    } else if trace_cost::is_trace_cost(&results) {
        trace_cost::write(&results, &opts.out);
    } else {
        report::write(&results, &opts.out);
    }
    results
}

/// Where a node keeps capture's state: `/run/capture`, and `/run` is a tmpfs on the
/// distributions nodes run. The benchmark's scratch directories (the agent's state directory
/// among them) go to `/dev/shm` likewise, unless `TMPDIR` says otherwise; on a disk file system
/// each ADD's two new files (the claim and the pod record) cost an inode allocation each.
///
/// Call it first thing in `main`, before any thread: it sets the process's environment.
pub fn scratch_on_tmpfs() {
    const SHM: &str = "/dev/shm";
    if std::env::var_os("TMPDIR").is_some() {
        return;
    }
    let on_tmpfs = nix::sys::statfs::statfs(SHM)
        .is_ok_and(|s| s.filesystem_type() == nix::sys::statfs::TMPFS_MAGIC);
    if on_tmpfs {
        std::env::set_var("TMPDIR", SHM);
    }
}
