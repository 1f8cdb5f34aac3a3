//! `cargo xtask bench`: capture's cost against the iptables path and against no capture at all,
//! measured side by side, interleaved, in rounds, on this machine.
//!
//! Each mode gets its own pod (netns + cgroup) wired to a remote netns; the same proxy and the
//! same load generator run in every mode. The limit (`none`) has no capture: the client dials
//! the proxy's listener directly.

pub mod cni_add;
pub mod report;
pub mod roles;

use std::{
    collections::BTreeMap,
    net::SocketAddr,
    path::PathBuf,
    process::{Command, Stdio},
    time::{Duration, Instant},
};

use serde::Serialize;

use self::roles::{LoadResult, Workload};
use crate::{
    guards::ChildGuard,
    probe::Who,
    topology::{Topology, POD_IP4},
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    /// No capture: the client dials the proxy directly (the limit).
    None,
    Iptables,
    Ebpf,
    /// ebpf with the app-to-proxy acceleration (sk_msg) on, whatever this kernel's checks found:
    /// the report says which differences were accepted for the measurement.
    EbpfAccel,
}

impl Mode {
    pub const ALL: [Self; 4] = [Self::None, Self::Iptables, Self::Ebpf, Self::EbpfAccel];
    #[must_use]
    pub fn name(self) -> &'static str {
        match self {
            Self::None => "none",
            Self::Iptables => "iptables",
            Self::Ebpf => "ebpf",
            Self::EbpfAccel => "ebpf+accel",
        }
    }
}

/// The network settings of the pods under test.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Settings {
    /// The kernel's defaults, as nodes run them (`tcp_tw_reuse=2`: TIME_WAIT ports are reused
    /// for loopback connections only).
    Default,
    /// Tuned for connection churn: `tcp_tw_reuse=1` and ports 1024-65000, so that no mode runs out
    /// of ephemeral ports in TIME_WAIT.
    Tuned,
}

impl Settings {
    const TUNED_SYSCTLS: [&'static str; 2] = [
        "net.ipv4.tcp_tw_reuse=1",
        "net.ipv4.ip_local_port_range=1024 65000",
    ];
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Proxy {
    /// A minimal echo listener: the cost of capture itself.
    Echo,
    /// Reads SO_ORIGINAL_DST and connects upstream (Envoy's outbound shape).
    Forward,
}

#[derive(Clone, Copy, Debug, Serialize)]
pub struct Cell {
    pub workload: Workload,
    pub concurrency: usize,
    pub inbound: bool,
    pub proxy: Proxy,
    pub settings: Settings,
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
            "{dir} {w} c{} ({:?} proxy{tuned})",
            self.concurrency, self.proxy
        )
        .to_lowercase()
    }
}

#[derive(Clone, Debug, Serialize)]
pub struct Sample {
    pub round: usize,
    pub mode: Mode,
    pub load: LoadResult,
    /// CPU time of the whole machine per operation, microseconds (from /proc/stat).
    pub cpu_us_per_op: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct CellResult {
    pub cell: Cell,
    pub label: String,
    pub samples: Vec<Sample>,
    /// After the cell's last round, per mode: what the pod's netns held.
    pub aftermath: Vec<(Mode, Aftermath)>,
}

/// What connection churn leaves in a pod's netns.
#[derive(Clone, Copy, Debug, Default, Serialize)]
pub struct Aftermath {
    /// Sockets in TIME_WAIT (each holds its 4-tuple, and its local port unless reused).
    pub time_wait: u64,
    /// Conntrack entries (iptables' REDIRECT needs one per connection).
    pub conntrack: u64,
}

/// What this kernel's acceleration checks found, accepted for the ebpf+accel measurement.
#[derive(Clone, Debug, Default, Serialize)]
pub struct AccelNote {
    pub differences: Vec<String>,
    pub cases: usize,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct AttachScale {
    pub mode: String,
    pub pods: usize,
    /// Attach latency in milliseconds, in attach order.
    pub latencies_ms: Vec<f64>,
    /// Unreclaimable kernel memory added per attached pod after the first, KiB.
    pub kib_per_pod: f64,
}

/// In-kernel cost of one capture program in the profiling pass (kernel.bpf_stats_enabled).
#[derive(Clone, Debug, Serialize)]
pub struct ProgramCost {
    pub program: String,
    pub runs: u64,
    pub ns_per_run: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct Results {
    pub kernel: String,
    pub cpus: usize,
    pub quick: bool,
    pub rounds: usize,
    pub seconds_per_sample: f64,
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
}

fn bench_bin() -> PathBuf {
    crate::built_binary("capture-bench", "CAPTURE_BENCH_BIN")
}

/// A role process of this binary, entered into a pod (or netns) as `who`.
fn role(
    netns: &std::path::Path,
    cgroup: Option<&std::path::Path>,
    who: &Who,
    args: &[String],
) -> Command {
    let mut cmd = Command::new(bench_bin());
    cmd.arg("role").arg("--netns").arg(netns);
    if let Some(cg) = cgroup {
        cmd.arg("--cgroup").arg(cg);
    }
    cmd.args(["--uid", &who.uid.to_string(), "--gid", &who.gid.to_string()])
        .args(args);
    cmd
}

/// One pod in one mode with one proxy, and its servers.
struct Bed {
    mode: Mode,
    topo: Topology,
    _servers: Vec<ChildGuard>,
}

impl Bed {
    fn new(mode: Mode, proxy: Proxy, settings: Settings, accel: &AccelNote) -> Self {
        let topo = Topology::new();
        if settings == Settings::Tuned {
            for ns in [&topo.pod.netns.name, &topo.remote.name] {
                for kv in Settings::TUNED_SYSCTLS {
                    crate::guards::run(
                        Command::new("ip").args(["netns", "exec", ns, "sysctl", "-qw", kv]),
                    );
                }
            }
        }
        match mode {
            Mode::None => {}
            Mode::Iptables | Mode::Ebpf => topo.attach(&["--mode", mode.name()]),
            Mode::EbpfAccel => {
                allow_acceleration(&topo, accel);
                topo.attach(&[
                    "--mode",
                    "ebpf",
                    "--annotation",
                    "capture.dev/accelerate=true",
                ]);
            }
        }
        let mut servers = Vec::new();
        let upstream = role(
            &topo.remote.path(),
            None,
            &Who::new(0, 0),
            &["echo".into(), "--listen".into(), "0.0.0.0:80".into()],
        );
        servers.push(ChildGuard::spawn_ready(&mut { upstream }));
        let proxy_args: Vec<String> = match proxy {
            Proxy::Echo => [
                "echo",
                "--listen",
                "0.0.0.0:15001",
                "--listen",
                "0.0.0.0:15006",
            ]
            .map(String::from)
            .to_vec(),
            Proxy::Forward => [
                "forward",
                "--listen",
                "0.0.0.0:15001",
                "--default-upstream",
                "10.0.0.5:80",
            ]
            .map(String::from)
            .to_vec(),
        };
        let mut p = role(
            &topo.pod.netns.path(),
            Some(&topo.pod.cgroup.path),
            &Who::proxy(),
            &proxy_args,
        );
        servers.push(ChildGuard::spawn_ready(&mut p));
        Self {
            mode,
            topo,
            _servers: servers,
        }
    }

    fn target(&self, cell: &Cell) -> SocketAddr {
        let s = match (self.mode, cell.inbound) {
            (Mode::None, false) => "127.0.0.1:15001".to_string(),
            (_, false) => "10.0.0.5:80".to_string(),
            (Mode::None, true) => format!("{POD_IP4}:15006"),
            (_, true) => format!("{POD_IP4}:8080"),
        };
        s.parse().expect("address")
    }

    fn run(&self, cell: &Cell, warmup: Duration, duration: Duration) -> (LoadResult, f64) {
        let mut args: Vec<String> = vec!["load".into(), "--workload".into()];
        args.push(format!("{:?}", cell.workload).to_lowercase());
        args.extend([
            "--target".into(),
            self.target(cell).to_string(),
            "--concurrency".into(),
            cell.concurrency.to_string(),
        ]);
        args.extend([
            "--warmup-ms".into(),
            warmup.as_millis().to_string(),
            "--duration-ms".into(),
            duration.as_millis().to_string(),
        ]);
        let mut cmd = if cell.inbound {
            role(&self.topo.remote.path(), None, &Who::new(0, 0), &args)
        } else {
            role(
                &self.topo.pod.netns.path(),
                Some(&self.topo.pod.cgroup.path),
                &Who::app(),
                &args,
            )
        };
        let cpu0 = cpu_jiffies();
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .expect("load generator");
        let cpu1 = cpu_jiffies();
        assert!(out.status.success(), "load generator failed");
        let load: LoadResult = serde_json::from_slice(&out.stdout).expect("load result");
        // The busy time covers warm-up and the measured window; scale to the measured part.
        let busy_s = (cpu1 - cpu0) as f64 / clock_ticks()
            * (load.seconds / (load.seconds + warmup.as_secs_f64()));
        let per_op = if load.ops == 0 {
            0.0
        } else {
            busy_s * 1e6 / load.ops as f64
        };
        (load, per_op)
    }

    /// Cumulative (run_cnt, run_time_ns) of this pod's capture programs (its own pinned set).
    fn program_counters(&self) -> BTreeMap<String, (u64, u64)> {
        let dir = crate::topology::node_pin_dir(&self.topo.dirs.bpffs).join("programs");
        let mut out = BTreeMap::new();
        for e in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let Ok(o) = Command::new("bpftool")
                .args(["-j", "prog", "show", "pinned"])
                .arg(e.path())
                .output()
            else {
                continue;
            };
            let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap_or_default();
            out.insert(
                e.file_name().to_string_lossy().into_owned(),
                (
                    v["run_cnt"].as_u64().unwrap_or(0),
                    v["run_time_ns"].as_u64().unwrap_or(0),
                ),
            );
        }
        out
    }

    /// A pass of its own, outside the measured rounds (the kernel's per-run accounting costs
    /// two clock reads per program run): program runs and time per connection of `cell`.
    fn profile(&self, cell: &Cell, duration: Duration) -> (Vec<ProgramCost>, u64) {
        const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
        let before_setting = std::fs::read_to_string(BPF_STATS).unwrap_or_else(|_| "0".into());
        let _ = std::fs::write(BPF_STATS, "1");
        let before = self.program_counters();
        let (load, _) = self.run(cell, Duration::ZERO, duration);
        let after = self.program_counters();
        let _ = std::fs::write(BPF_STATS, before_setting.trim());
        let costs = after
            .into_iter()
            .map(|(program, (runs, ns))| {
                let (runs0, ns0) = before.get(&program).copied().unwrap_or_default();
                let (runs, ns) = (runs.saturating_sub(runs0), ns.saturating_sub(ns0));
                ProgramCost {
                    program,
                    runs,
                    ns_per_run: if runs == 0 {
                        0.0
                    } else {
                        ns as f64 / runs as f64
                    },
                }
            })
            .filter(|c| c.runs > 0)
            .collect();
        (costs, load.ops)
    }

    /// TIME_WAIT sockets and conntrack entries in the pod's netns now.
    fn aftermath(&self) -> Aftermath {
        let tcp = Command::new("nsenter")
            .arg(format!("--net={}", self.topo.pod.netns.path().display()))
            .args(["cat", "/proc/net/tcp", "/proc/net/tcp6"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        // The fourth column is the state; 06 is TIME_WAIT.
        let time_wait = tcp
            .lines()
            .filter(|l| l.split_whitespace().nth(3) == Some("06"))
            .count() as u64;
        Aftermath {
            time_wait,
            conntrack: self.conntrack_entries(),
        }
    }

    fn conntrack_entries(&self) -> u64 {
        let out = Command::new("nsenter")
            .arg(format!("--net={}", self.topo.pod.netns.path().display()))
            .args(["cat", "/proc/sys/net/netfilter/nf_conntrack_count"])
            .output();
        out.ok()
            .and_then(|o| String::from_utf8_lossy(&o.stdout).trim().parse().ok())
            .unwrap_or(0)
    }
}

/// Busy jiffies of the whole machine (user+nice+system+irq+softirq+steal).
fn cpu_jiffies() -> u64 {
    let stat = std::fs::read_to_string("/proc/stat").unwrap_or_default();
    let cpu = stat.lines().next().unwrap_or_default();
    let f: Vec<u64> = cpu
        .split_whitespace()
        .skip(1)
        .filter_map(|v| v.parse().ok())
        .collect();
    // user nice system idle iowait irq softirq steal
    [0, 1, 2, 5, 6, 7].iter().filter_map(|i| f.get(*i)).sum()
}

fn clock_ticks() -> f64 {
    // SAFETY: sysconf has no preconditions.
    (unsafe { libc::sysconf(libc::_SC_CLK_TCK) }) as f64
}

/// Every workload under the kernel's defaults (the headline), and connection churn again under
/// tuned settings.
fn cells(concurrency: usize) -> Vec<Cell> {
    let c = |workload, concurrency, inbound, proxy, settings| Cell {
        workload,
        concurrency,
        inbound,
        proxy,
        settings,
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

/// Allows acceleration on the bed's node, accepting the differences the checks found.
fn allow_acceleration(topo: &Topology, accel: &AccelNote) {
    let mut args = vec!["accel-check", "--allow"];
    let accepting = accel.differences.join(",");
    if !accepting.is_empty() {
        args.extend(["--accepting", &accepting]);
    }
    let out = topo.capture(&args);
    assert!(
        out.status.success(),
        "accel-check --allow: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Unreclaimable kernel memory, KiB: where BPF links, program arrays and map entries live
/// (kmalloc, per-cpu and vmalloc allocations). Page cache and reclaimable slab are left out.
fn kernel_memory_kib() -> u64 {
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
        t.attach(&["--mode", mode.name()]);
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

/// Runs the whole benchmark and writes results.json, benchmarks.md and the chart.
pub fn run(opts: &Options) -> Results {
    crate::require_root();
    let (rounds, seconds, concurrency, pods) = if opts.quick {
        (3, 0.6, 8, 40)
    } else {
        (5, 3.0, 8, 1000)
    };
    let warmup = Duration::from_millis(if opts.quick { 150 } else { 500 });
    let duration = Duration::from_secs_f64(seconds);
    let cells = cells(concurrency);
    let mut results: Vec<CellResult> = cells
        .iter()
        .map(|c| CellResult {
            cell: *c,
            label: c.label(),
            samples: Vec::new(),
            aftermath: Vec::new(),
        })
        .collect();
    let mut conntrack = Vec::new();
    let mut profile = (Vec::new(), 0);
    let mut accel_profile = (Vec::new(), 0);
    eprintln!("bench: running the acceleration checks");
    let accel = check_acceleration();
    for (proxy, settings) in [
        (Proxy::Echo, Settings::Default),
        (Proxy::Echo, Settings::Tuned),
        (Proxy::Forward, Settings::Default),
        (Proxy::Forward, Settings::Tuned),
    ] {
        eprintln!(
            "bench: setting up the {proxy:?} proxy ({settings:?} settings) in a pod per mode"
        );
        let beds: Vec<Bed> = Mode::ALL
            .iter()
            .map(|m| Bed::new(*m, proxy, settings, &accel))
            .collect();
        let ours = |c: &Cell| c.proxy == proxy && c.settings == settings;
        for round in 0..rounds {
            for (i, cell) in cells.iter().enumerate().filter(|(_, c)| ours(c)) {
                // Interleaved: the modes' order rotates every round and cell.
                for k in 0..beds.len() {
                    let bed = &beds[(round + i + k) % beds.len()];
                    let (load, cpu) = bed.run(cell, warmup, duration);
                    eprintln!(
                        "bench: round {round} {:<48} {:<8} {:>10.0} ops/s  p50 {:>6.0}us  cpu/op {:>6.1}us",
                        cell.label(),
                        bed.mode.name(),
                        load.ops as f64 / load.seconds,
                        load.p50_us,
                        cpu
                    );
                    results[i].samples.push(Sample {
                        round,
                        mode: bed.mode,
                        load,
                        cpu_us_per_op: cpu,
                    });
                    if round + 1 == rounds && cell.workload == Workload::Crr {
                        results[i].aftermath.push((bed.mode, bed.aftermath()));
                    }
                }
            }
        }
        if proxy == Proxy::Echo && settings == Settings::Default {
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
    eprintln!("bench: attaching {pods} pods per backend");
    let attach = [Mode::Ebpf, Mode::Iptables]
        .iter()
        .map(|m| {
            attach_scale(
                *m,
                if *m == Mode::Iptables {
                    pods.min(200)
                } else {
                    pods
                },
            )
        })
        .collect();
    let cni_pods = if opts.quick { 10 } else { 100 };
    eprintln!("bench: CNI ADD of {cni_pods} pods per backend through capture-cni and the agent");
    let cni_add = ["ebpf", "iptables"]
        .iter()
        .map(|m| cni_add::measure(m, cni_pods))
        .collect();
    let kernel = nix::sys::utsname::uname()
        .map(|u| u.release().to_string_lossy().into_owned())
        .unwrap_or_default();
    let results = Results {
        kernel,
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        quick: opts.quick,
        rounds,
        seconds_per_sample: seconds,
        cells: results,
        conntrack_entries: conntrack,
        attach,
        cni_add,
        program_costs: profile.0,
        profiled_connections: profile.1,
        accel,
        accel_program_costs: accel_profile.0,
        accel_profiled_requests: accel_profile.1,
    };
    report::write(&results, &opts.out);
    results
}
