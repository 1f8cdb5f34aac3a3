//! One pod per mode with its proxy and servers, and how a load run is measured in it: rate,
//! latency, the machine's CPU per operation, the programs' own time, what churn leaves behind.

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4},
    path::PathBuf,
    process::{Command, Stdio},
    time::Duration,
};

use capture_tests::{
    guards::ChildGuard,
    haproxy::Haproxy,
    probe::Who,
    topology::{Topology, POD_IP4, POD_IP6},
};

use super::{
    cpus::Cpus, roles::LoadResult, AccelNote, Aftermath, Cell, Family, Mode, ProgramCost, Proxy,
    Settings,
};

/// The remote address the pods' outbound load goes to unless told otherwise.
pub(super) const DEFAULT_UPSTREAM: Ipv4Addr = Ipv4Addr::new(10, 0, 0, 5);
/// The remote address the pods' IPv6 outbound load goes to.
const DEFAULT_UPSTREAM6: Ipv6Addr = Ipv6Addr::new(0xfd00, 2, 0, 0, 0, 0, 0, 5);

pub(super) fn bench_bin() -> PathBuf {
    capture_tests::built_binary("capture-bench", "CAPTURE_BENCH_BIN")
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

/// What one load run measured, and the CPU it took per operation.
pub(super) struct Measured {
    pub(super) load: LoadResult,
    /// The whole machine's busy time, microseconds.
    pub(super) cpu_us_per_op: f64,
    /// The pod's processes' (its cgroup's), microseconds.
    pub(super) pod_cpu_us_per_op: f64,
}

/// One pod in one mode with one proxy, and its servers.
pub(super) struct Bed {
    pub(super) mode: Mode,
    proxy: Proxy,
    /// The sidecar when it is HAProxy; before `topo`, so it stops before its pod goes.
    haproxy: Option<Haproxy>,
    /// The proxy's container cgroup (`ebpf+identity`); before `topo`, so it goes first.
    #[expect(
        dead_code,
        reason = "held for its drop, which removes the cgroup before the pod's"
    )]
    proxy_cgroup: Option<capture_tests::guards::CgroupGuard>,
    topo: Topology,
    servers: Vec<ChildGuard>,
}

/// The echo proxy's listeners: both families' (the IPv6 ones `IPV6_V6ONLY`, as Envoy opens
/// them beside the IPv4 ones).
const ECHO_LISTENERS: [&str; 4] = ["0.0.0.0:15001", "0.0.0.0:15006", "[::]:15001", "[::]:15006"];

impl Bed {
    #[expect(
        clippy::too_many_lines,
        reason = "one test bed set up in the order its parts depend on each other: pod, capture, proxy, servers"
    )]
    pub(super) fn new(
        mode: Mode,
        proxy: Proxy,
        settings: Settings,
        ipv6_only: bool,
        accel: &AccelNote,
    ) -> Self {
        let mut topo = Topology::new();
        if settings == Settings::Tuned {
            for ns in [&topo.pod.netns.name, &topo.remote.name] {
                for kv in Settings::TUNED_SYSCTLS {
                    capture_tests::guards::run(
                        Command::new("ip").args(["netns", "exec", ns, "sysctl", "-qw", kv]),
                    );
                }
            }
        }
        let proxy_cgroup =
            (mode == Mode::EbpfIdentity).then(|| topo.pod.cgroup.child("istio-proxy"));
        // An IPv6-only pod is attached naming its IPv6 address alone.
        let attach = |topo: &Topology, args: &[&str]| {
            if !ipv6_only {
                return topo.attach(args);
            }
            let out = topo.try_attach_with_ips(&[&topo.ip6], args);
            assert!(out.status.success(), "capture attach: {out:?}");
        };
        match mode {
            Mode::None => {}
            Mode::EbpfIdentity => {
                let cgroup = proxy_cgroup.as_ref().map(|c| c.path.display().to_string());
                attach(
                    &topo,
                    &[
                        "--mode",
                        "ebpf",
                        "--proxy-identity",
                        "container",
                        "--proxy-cgroup",
                        cgroup.as_deref().unwrap_or_default(),
                    ],
                );
            }
            Mode::Iptables | Mode::Nftables | Mode::Ebpf => attach(&topo, &["--mode", mode.name()]),
            Mode::EbpfNotrace | Mode::EbpfTrace => {
                if mode == Mode::EbpfNotrace {
                    topo.capture_env
                        .push(("CAPTURE_WITHOUT_TRACE", "1".to_string()));
                }
                attach(&topo, &["--mode", "ebpf"]);
            }
            Mode::EbpfAccel => {
                allow_acceleration(&topo, accel);
                attach(
                    &topo,
                    &[
                        "--mode",
                        "ebpf",
                        "--annotation",
                        "capture.dev/accelerate=true",
                    ],
                );
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
        let proxy_home = proxy_cgroup
            .as_ref()
            .map_or(&topo.pod.cgroup.path, |c| &c.path);
        // The benchmark's own proxies are roles of this binary; HAProxy is started below.
        let role_args: Option<Vec<String>> = match proxy {
            Proxy::Haproxy => None,
            Proxy::Echo => Some(
                std::iter::once("echo".to_string())
                    .chain(
                        ECHO_LISTENERS
                            .iter()
                            .flat_map(|a| ["--listen".into(), a.to_string()]),
                    )
                    .collect(),
            ),
            Proxy::Forward => Some(
                [
                    "forward",
                    "--listen",
                    "0.0.0.0:15001",
                    "--default-upstream",
                    &format!("{DEFAULT_UPSTREAM}:80"),
                ]
                .map(String::from)
                .to_vec(),
            ),
        };
        // Beside HAProxy, `none` is no mesh: no proxy at all, the app dials the upstream itself.
        let haproxy = (proxy == Proxy::Haproxy && mode != Mode::None).then(|| {
            Haproxy::start_default_sidecar(&topo.pod.netns.path(), proxy_home, &Who::proxy())
        });
        if let Some(args) = role_args {
            let mut p = role(
                &topo.pod.netns.path(),
                Some(proxy_home),
                &Who::proxy(),
                &args,
            );
            servers.push(ChildGuard::spawn_ready(&mut p));
        }
        if mode == Mode::EbpfTrace {
            // Every decision emitted and read: no rate limit to speak of.
            let netns = topo.pod.netns.path();
            let mut trace = topo.capture_command(&[
                "trace",
                "--json",
                "--rate",
                "1000000000",
                "--netns",
                netns.to_str().expect("netns path"),
            ]);
            trace.stdout(Stdio::null()).stderr(Stdio::null());
            servers.push(ChildGuard::spawn(&mut trace));
        }
        Self {
            mode,
            proxy,
            haproxy,
            proxy_cgroup,
            topo,
            servers,
        }
    }

    /// Runs this bed's servers, and the processes this thread starts from now on, on `cpus`.
    fn place(&self, cpus: &Cpus) {
        cpus.confine_self();
        for server in &self.servers {
            cpus.confine_process(server.pid());
        }
        if let Some(haproxy) = &self.haproxy {
            cpus.confine_process(haproxy.pid());
        }
    }

    /// Where the load generator connects: outbound, `upstream` (`DEFAULT_UPSTREAM` unless given,
    /// `DEFAULT_UPSTREAM6` for IPv6) on the remote side's port 80, which every remote address
    /// serves; without capture, the proxy itself on the loopback address of the family.
    fn target(&self, cell: &Cell, upstream: Option<Ipv4Addr>) -> SocketAddr {
        let ipv6 = cell.family != Family::Ipv4;
        let (remote, localhost, pod) = if ipv6 {
            (
                SocketAddr::from((DEFAULT_UPSTREAM6, 80)),
                "[::1]".to_string(),
                format!("[{POD_IP6}]"),
            )
        } else {
            (
                SocketAddr::from((upstream.unwrap_or(DEFAULT_UPSTREAM), 80)),
                "127.0.0.1".to_string(),
                POD_IP4.to_string(),
            )
        };
        let s = match (self.mode, cell.inbound) {
            (Mode::None, false) if self.proxy == Proxy::Haproxy => remote.to_string(),
            (Mode::None, false) => format!("{localhost}:15001"),
            (_, false) => remote.to_string(),
            (Mode::None, true) => format!("{pod}:15006"),
            (_, true) => format!("{pod}:8080"),
        };
        s.parse().expect("address")
    }

    /// One load run of `cell`, outbound to `upstream` when given (see `target`).
    pub(super) fn run(
        &self,
        cell: &Cell,
        upstream: Option<Ipv4Addr>,
        warmup: Duration,
        duration: Duration,
        one_cpu_for_one_client: bool,
    ) -> Measured {
        let mut args: Vec<String> = vec!["load".into(), "--workload".into()];
        args.push(format!("{:?}", cell.workload).to_lowercase());
        args.extend([
            "--target".into(),
            self.target(cell, upstream).to_string(),
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
        // One client: every process of the run on one CPU (cpus.rs), the same in every mode.
        let all = Cpus::allowed();
        let one = (one_cpu_for_one_client && cell.concurrency == 1)
            .then(|| all.last_alone())
            .flatten();
        if let Some(one) = &one {
            self.place(one);
        }
        let (cpu0, pod_cpu0) = (cpu_jiffies(), self.pod_cpu_usec());
        let out = cmd
            .stderr(Stdio::inherit())
            .output()
            .expect("load generator");
        let (cpu1, pod_cpu1) = (cpu_jiffies(), self.pod_cpu_usec());
        if one.is_some() {
            self.place(&all);
        }
        assert!(out.status.success(), "load generator failed");
        let load: LoadResult = serde_json::from_slice(&out.stdout).expect("load result");
        // The busy time covers warm-up and the measured window; scale to the measured part.
        let measured_share = load.seconds / (load.seconds + warmup.as_secs_f64());
        let per_op = |busy_us: f64| {
            if load.ops == 0 {
                0.0
            } else {
                busy_us * measured_share / load.ops as f64
            }
        };
        Measured {
            cpu_us_per_op: per_op((cpu1 - cpu0) as f64 / clock_ticks() * 1e6),
            pod_cpu_us_per_op: per_op(pod_cpu1.saturating_sub(pod_cpu0) as f64),
            load,
        }
    }

    /// CPU time of the pod cgroup's processes so far (its `cpu.stat`, which cgroup v2 keeps
    /// without the cpu controller), microseconds.
    fn pod_cpu_usec(&self) -> u64 {
        std::fs::read_to_string(self.topo.pod.cgroup.path.join("cpu.stat"))
            .unwrap_or_default()
            .lines()
            .find_map(|l| l.strip_prefix("usage_usec "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    }

    /// The values of `keys` in the pod's netns, as `sysctl` prints them.
    pub(super) fn pod_sysctls(&self, keys: &[&str]) -> Vec<(String, String)> {
        keys.iter()
            .map(|key| {
                let out = Command::new("ip")
                    .args([
                        "netns",
                        "exec",
                        &self.topo.pod.netns.name,
                        "sysctl",
                        "-n",
                        key,
                    ])
                    .output();
                let value = out.map_or_else(
                    |e| format!("({e})"),
                    |o| {
                        String::from_utf8_lossy(&o.stdout)
                            .split_whitespace()
                            .collect::<Vec<_>>()
                            .join(" ")
                    },
                );
                ((*key).to_string(), value)
            })
            .collect()
    }

    /// Cumulative (`run_cnt`, `run_time_ns`) of this pod's capture programs (its own pinned set).
    fn program_counters(&self) -> BTreeMap<String, (u64, u64)> {
        let dir = capture_tests::topology::node_pin_dir(&self.topo.dirs.bpffs).join("programs");
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
    pub(super) fn profile(&self, cell: &Cell, duration: Duration) -> (Vec<ProgramCost>, u64) {
        const BPF_STATS: &str = "/proc/sys/kernel/bpf_stats_enabled";
        let before_setting = std::fs::read_to_string(BPF_STATS).unwrap_or_else(|_| "0".into());
        let _ = std::fs::write(BPF_STATS, "1");
        let before = self.program_counters();
        let load = self.run(cell, None, Duration::ZERO, duration, true).load;
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

    /// `TIME_WAIT` sockets and conntrack entries in the pod's netns now.
    pub(super) fn aftermath(&self) -> Aftermath {
        Aftermath {
            time_wait: self.time_wait_sockets().len() as u64,
            conntrack: self.conntrack_entries(),
        }
    }

    /// The pod's TCP sockets in `TIME_WAIT`, as /proc/net/tcp{,6} lines.
    fn time_wait_sockets(&self) -> Vec<String> {
        let tcp = Command::new("nsenter")
            .arg(format!("--net={}", self.topo.pod.netns.path().display()))
            .args(["cat", "/proc/net/tcp", "/proc/net/tcp6"])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        // The fourth column is the state; 06 is TIME_WAIT.
        tcp.lines()
            .filter(|l| l.split_whitespace().nth(3) == Some("06"))
            .map(String::from)
            .collect()
    }

    /// The pod's sockets in `TIME_WAIT` whose peer is `to`: each holds a local port of the pod
    /// toward `to` until it ends.
    pub(super) fn time_wait_toward(&self, to: SocketAddrV4) -> u64 {
        // The kernel prints the address as the u32 it stores (network order) in host order.
        let peer = format!(
            "{:08X}:{:04X}",
            u32::from_ne_bytes(to.ip().octets()),
            to.port()
        );
        self.time_wait_sockets()
            .iter()
            .filter(|l| l.split_whitespace().nth(2) == Some(peer.as_str()))
            .count() as u64
    }

    pub(super) fn conntrack_entries(&self) -> u64 {
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
