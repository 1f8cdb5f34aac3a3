//! `cargo xtask bench --real-proxy`: what capture changes end to end, with a real proxy as the
//! sidecar. Debian's HAProxy runs in the pod as the proxy's uid with its default settings, apart
//! from what transparent forwarding needs (`server … 0.0.0.0:0`: each connection goes to its
//! `SO_ORIGINAL_DST`), as tests/tests/hooks/haproxy.rs runs it. The app in the pod dials an echo
//! server outside the pod; the baseline is no mesh at all (no proxy, no capture), so the ratios
//! hold the proxy's cost as well as the capture hop's: what a user moving a pod into the mesh
//! would see. The pods keep the kernel's default sysctls.
//!
//! Under those defaults a pod's connections to one destination leave its ports in `TIME_WAIT`
//! for a minute, and a pod that churns faster than its ports free up ends up waiting for ports,
//! not for the path: every sample therefore dials a destination address of its own (all served by
//! the same upstream), to measure the path, and a separate pass measures how many ports each
//! connection holds, which sets the rate a pod can sustain to one destination.
//!
//! The same beds, rounds and statistics as the synthetic benchmark (mod.rs); writes
//! real-proxy.md and real-proxy.json.

mod report;

use std::{
    net::{Ipv4Addr, SocketAddrV4},
    path::PathBuf,
    time::Duration,
};

use capture_tests::haproxy::{default_sidecar_config, Haproxy};
use serde::{Deserialize, Serialize};

pub use self::report::{markdown, write};
use super::{
    bed::Bed, cpus::Cpus, roles::Workload, AccelNote, Cell, CellResult, Family, Mode, Proxy,
    Schedule, Settings,
};

/// The modes compared: no mesh, the two rule backends, ebpf. (The acceleration is left out: it
/// answers for the app-to-proxy hop, which the synthetic benchmark measures.)
pub const MODES: [Mode; 4] = [Mode::None, Mode::Iptables, Mode::Nftables, Mode::Ebpf];

/// The sysctls of the pod's netns the report states (what a new netns starts with, and the
/// node's conntrack table).
const SYSCTLS: [&str; 9] = [
    "net.ipv4.tcp_tw_reuse",
    "net.ipv4.ip_local_port_range",
    "net.ipv4.tcp_max_tw_buckets",
    "net.ipv4.tcp_fin_timeout",
    "net.core.somaxconn",
    "net.ipv4.tcp_congestion_control",
    "net.netfilter.nf_conntrack_max",
    "net.netfilter.nf_conntrack_buckets",
    "net.netfilter.nf_conntrack_tcp_timeout_time_wait",
];

/// The destination of the ports-held pass: not one a sample dials (they start at 10.0.1.0).
const PORTS_HELD_UPSTREAM: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 100);

/// How long a closed connection holds its port in `TIME_WAIT`: fixed in the kernel
/// (`TCP_TIMEWAIT_LEN`), no sysctl changes it.
const TIME_WAIT_SECONDS: f64 = 60.0;

pub struct Options {
    pub quick: bool,
    pub out: PathBuf,
    /// Rounds instead of the default (25, quick 3).
    pub rounds: Option<usize>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct RealProxyResults {
    pub kernel: String,
    pub cpu_model: String,
    pub cpus: usize,
    pub quick: bool,
    pub rounds: usize,
    pub seconds_per_sample: f64,
    pub warmup_seconds: f64,
    pub one_client_on_one_cpu: bool,
    /// `haproxy -v`'s first line.
    pub haproxy_version: String,
    /// What `haproxy -vv` says of its threads (how many it runs by default).
    pub haproxy_threads: String,
    pub haproxy_config: String,
    /// HAProxy's open-files limit, from which it sizes its maxconn.
    pub open_files_limit: u64,
    /// The pod netns' sysctls as the run found them.
    pub sysctls: Vec<(String, String)>,
    pub cells: Vec<CellResult>,
    /// Per mode, the pass that counts the ports a connection holds.
    pub ports_held: Vec<(Mode, PortsHeld)>,
}

/// A short churn run to a destination nothing else dialled, and the pod's sockets left in
/// `TIME_WAIT` toward it: each holds one of the pod's ports toward that destination.
#[derive(Clone, Copy, Debug, Default, Serialize, Deserialize)]
pub struct PortsHeld {
    pub connections: u64,
    pub time_wait: u64,
}

impl PortsHeld {
    #[must_use]
    pub fn per_connection(&self) -> f64 {
        if self.connections == 0 {
            0.0
        } else {
            self.time_wait as f64 / self.connections as f64
        }
    }
}

/// Counts the ports each connection of `bed`'s app holds (`PortsHeld`), on the pod's fresh
/// destination `upstream`. The run has no warm-up, so that every connection it makes is
/// counted (but the one in flight when it stops).
fn ports_held(bed: &Bed, upstream: Ipv4Addr) -> PortsHeld {
    let churn = Cell {
        workload: Workload::Crr,
        concurrency: 1,
        inbound: false,
        proxy: Proxy::Haproxy,
        settings: Settings::Default,
        family: Family::Ipv4,
    };
    let run = bed.run(
        &churn,
        Some(upstream),
        Duration::ZERO,
        Duration::from_millis(300),
        true,
    );
    PortsHeld {
        connections: run.load.ops,
        time_wait: bed.time_wait_toward(SocketAddrV4::new(upstream, 80)),
    }
}

/// Connection churn with one client and with eight, and request/response on a persistent
/// connection, all outbound.
fn cells() -> Vec<Cell> {
    [(Workload::Crr, 1), (Workload::Crr, 8), (Workload::Rr, 1)]
        .map(|(workload, concurrency)| Cell {
            workload,
            concurrency,
            inbound: false,
            proxy: Proxy::Haproxy,
            settings: Settings::Default,
            family: Family::Ipv4,
        })
        .to_vec()
}

fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_string())
        .unwrap_or_default()
}

fn open_files_limit() -> u64 {
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `limit` is an rlimit for getrlimit to fill.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut limit) };
    if rc == 0 {
        limit.rlim_cur
    } else {
        0
    }
}

/// Runs the modes' pods side by side and writes real-proxy.md and real-proxy.json.
pub fn run(opts: &Options) -> RealProxyResults {
    capture_tests::require_root();
    let haproxy_version = Haproxy::version();
    assert!(
        !haproxy_version.is_empty(),
        "no haproxy on PATH: `cargo xtask setup` installs Debian's haproxy"
    );
    // Samples short enough that no mode runs out of ports toward a sample's destination within
    // one (the fastest churn here, eight clients without a mesh, made 22,000 connections a
    // second on the reference machine, against 28,232 ports), and many rounds of them.
    let (rounds, seconds, warmup) = if opts.quick {
        (3, 0.5, 0.1)
    } else {
        (25, 0.6, 0.15)
    };
    let schedule = Schedule {
        rounds: opts.rounds.unwrap_or(rounds),
        warmup: Duration::from_secs_f64(warmup),
        duration: Duration::from_secs_f64(seconds),
        one_cpu_for_one_client: true,
        fresh_upstream_per_sample: true,
    };
    let cells = cells();
    let mut results: Vec<CellResult> = cells.iter().copied().map(CellResult::new).collect();
    eprintln!("bench: {haproxy_version} as the sidecar of a pod per mode");
    let beds: Vec<Bed> = MODES
        .iter()
        .map(|m| {
            Bed::new(
                *m,
                Proxy::Haproxy,
                Settings::Default,
                false,
                &AccelNote::default(),
            )
        })
        .collect();
    // From a pod of the rule backends, where conntrack (whose settings are among them) is in use.
    let sysctls = beds
        .iter()
        .find(|b| b.mode == Mode::Iptables)
        .unwrap_or(&beds[0])
        .pod_sysctls(&SYSCTLS)
        .into_iter()
        .filter(|(_, v)| !v.is_empty())
        .collect();
    // Before the rounds, while no pod holds many sockets in TIME_WAIT (the kernel stops keeping
    // them past `tcp_max_tw_buckets`, which would hide ports held).
    eprintln!("bench: counting the ports a connection holds in each mode");
    let ports_held = beds
        .iter()
        .map(|bed| (bed.mode, ports_held(bed, PORTS_HELD_UPSTREAM)))
        .collect();
    schedule.measure(&beds, &cells, &mut results, |_| true);
    drop(beds);
    let results = RealProxyResults {
        kernel: super::kernel_release(),
        cpu_model: cpu_model(),
        cpus: std::thread::available_parallelism().map_or(1, usize::from),
        quick: opts.quick,
        rounds: schedule.rounds,
        seconds_per_sample: seconds,
        warmup_seconds: warmup,
        one_client_on_one_cpu: Cpus::allowed().last_alone().is_some(),
        haproxy_version,
        haproxy_threads: Haproxy::threads(),
        haproxy_config: default_sidecar_config(),
        open_files_limit: open_files_limit(),
        sysctls,
        cells: results,
        ports_held,
    };
    write(&results, &opts.out);
    results
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_config_forwards_to_the_original_destination_and_sets_nothing_else() {
        let config = default_sidecar_config();
        let settings: Vec<&str> = config
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(
            settings,
            [
                "defaults",
                "mode tcp",
                "timeout connect 5s",
                "timeout client 30s",
                "timeout server 30s",
                "listen outbound",
                "bind 0.0.0.0:15001",
                "server original 0.0.0.0:0",
            ]
        );
    }
}
