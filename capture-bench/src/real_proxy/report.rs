//! real-proxy.md: the end-to-end run's medians, ratios and conditions.

use std::{fmt::Write as _, path::Path};

use super::{RealProxyResults, MODES, TIME_WAIT_SECONDS};
use capture_tests::haproxy::OUTBOUND_PORT;

use crate::{
    roles::{self, Workload},
    stats::{median, paired, summarize, Paired},
    CellResult, Mode,
};

fn mode_name(mode: Mode) -> &'static str {
    if mode == Mode::None {
        "no mesh"
    } else {
        mode.name()
    }
}

fn ratio(a: f64, b: f64) -> String {
    if b > 0.0 {
        format!("{:.2}x", a / b)
    } else {
        String::new()
    }
}

fn per_round(p: Option<Paired>) -> String {
    p.map_or_else(String::new, |p| {
        format!("{:.2}x ({:.2}..{:.2})", p.median, p.min, p.max)
    })
}

fn sysctl<'a>(r: &'a RealProxyResults, key: &str) -> Option<&'a str> {
    r.sysctls
        .iter()
        .find(|(k, _)| k == key)
        .map(|(_, v)| v.as_str())
}

/// Ephemeral ports in the pod's range.
fn ephemeral_ports(r: &RealProxyResults) -> Option<u32> {
    let range = sysctl(r, "net.ipv4.ip_local_port_range")?;
    let (low, high) = range.split_once(' ')?;
    let (low, high): (u32, u32) = (low.trim().parse().ok()?, high.trim().parse().ok()?);
    Some(high.saturating_sub(low) + 1)
}

/// One line of what ebpf capture gives on a workload, against iptables and against no mesh.
fn headline(cell: &CellResult) -> String {
    let ebpf = summarize(cell, Mode::Ebpf);
    let round_median = |baseline| {
        paired(cell, Mode::Ebpf, baseline).map_or_else(String::new, |p| format!("{:.2}x", p.median))
    };
    format!(
        "{}: ebpf {:.0} ops/s, {} iptables and {} no mesh (per round {} and {})",
        cell.label,
        ebpf.rate,
        ratio(ebpf.rate, summarize(cell, Mode::Iptables).rate),
        ratio(ebpf.rate, summarize(cell, Mode::None).rate),
        round_median(Mode::Iptables),
        round_median(Mode::None),
    )
}

#[must_use]
pub fn markdown(r: &RealProxyResults) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# End to end, with HAProxy as the sidecar\n");
    let _ = writeln!(
        o,
        "Produced by `cargo xtask bench --real-proxy{}`. What a pod's app sees of the mesh, with a real proxy in the pod and the kernel's default settings: the synthetic benchmark ([benchmarks.md](benchmarks.md)) measures the capture hop alone, this one the whole path.\n",
        if r.quick { " --quick" } else { "" }
    );
    for cell in &r.cells {
        let _ = writeln!(o, "- {}", headline(cell));
    }
    if let Some(ports) = ephemeral_ports(r) {
        let _ = writeln!(
            o,
            "- connect+rr+close to one destination, sustained: {}",
            r.ports_held
                .iter()
                .map(|(mode, held)| format!(
                    "{} {:.0} connections/s",
                    mode_name(*mode),
                    sustained(ports, held.per_connection())
                ))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    let _ = writeln!(o, "\n## What runs\n");
    let _ = writeln!(o, "Each mode has a pod of its own (netns and cgroup) joined by a veth to a netns outside it, where one echo server answers on port 80 of every address of 10.0.0.0/16. The app (uid 1000, in the pod) dials one of those addresses: each request and each answer is {} bytes.\n", roles::MESSAGE);
    let _ = writeln!(o, "- **no mesh**: no proxy and no capture; the app's connections go straight to the upstream.");
    let _ = writeln!(o, "- **iptables**, **nftables**, **ebpf**: `capture attach --mode …` captures the pod and HAProxy runs in it as uid 1337. Capture sends the app's connection to HAProxy's {OUTBOUND_PORT}, and HAProxy opens its own connection to the original destination, which it reads with `SO_ORIGINAL_DST`.\n");
    let _ = writeln!(o, "Workloads: **connect+rr+close**, a new connection for each request (connection churn), with one client and with eight concurrent ones; **persistent rr**, requests one after the other on one connection. An op is one request and its answer, with the connect and close in churn.\n");
    let _ = writeln!(o, "## The path\n");
    let _ = writeln!(o, "Every sample dials a destination address of its own (10.0.1.0 onwards), which no earlier sample left ports in TIME_WAIT toward, and is short enough not to use up the pod's ports toward it: these rows are what the path costs, where churn is not limited by ports (see the next section for where it is).\n");
    let _ = writeln!(o, "Rates are medians over rounds, the range min..max; latencies are the medians of each sample's percentiles. Pod CPU is the CPU time of the pod's cgroup (the app and HAProxy, kernel work in their context included) per op; machine CPU is the whole machine's busy time per op, which counts the upstream and anything else running. Errors are failed ops per second. \"vs\" divides two medians; \"per round\" divides the two modes' rates within each round, seconds apart, and gives the median (min..max) of those ratios, which the machine's drift over minutes moves less.\n");
    let _ = writeln!(o, "| workload | mode | rate | range | p50 µs | p99 µs | pod CPU µs/op | machine CPU µs/op | errors/s | vs no mesh | vs no mesh, per round | vs iptables | vs iptables, per round |");
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    for cell in &r.cells {
        let none = summarize(cell, Mode::None);
        let ipt = summarize(cell, Mode::Iptables);
        for mode in MODES {
            let s = summarize(cell, mode);
            let (vs_none, vs_none_round) = if mode == Mode::None {
                (String::new(), String::new())
            } else {
                (
                    ratio(s.rate, none.rate),
                    per_round(paired(cell, mode, Mode::None)),
                )
            };
            let (vs_ipt, vs_ipt_round) = if matches!(mode, Mode::Nftables | Mode::Ebpf) {
                (
                    ratio(s.rate, ipt.rate),
                    per_round(paired(cell, mode, Mode::Iptables)),
                )
            } else {
                (String::new(), String::new())
            };
            let _ = writeln!(
                o,
                "| {} | {} | {:.0} ops/s | {:.0}..{:.0} | {:.0} | {:.0} | {:.1} | {:.1} | {:.0} | {vs_none} | {vs_none_round} | {vs_ipt} | {vs_ipt_round} |",
                cell.label,
                mode_name(mode),
                s.rate,
                s.rate_min,
                s.rate_max,
                s.p50,
                s.p99,
                s.pod_cpu,
                s.cpu,
                s.errors,
            );
        }
    }
    over_the_run(&mut o, r);
    port_budget(&mut o, r);
    conditions(&mut o, r);
    o
}

/// Median rate of `mode` on `cell` over the rounds in `rounds`.
fn rate_in(cell: &CellResult, mode: Mode, rounds: std::ops::Range<usize>) -> f64 {
    median(
        cell.samples
            .iter()
            .filter(|s| s.mode == mode && rounds.contains(&s.round) && s.load.seconds > 0.0)
            .map(|s| s.load.ops as f64 / s.load.seconds)
            .collect(),
    )
}

/// Churn in the run's first and last thirds of rounds: what a pod accumulates over the run
/// shows where one mode slows and the others, in the same rounds, do not.
fn over_the_run(o: &mut String, r: &RealProxyResults) {
    let third = r.rounds / 3;
    if third == 0 {
        return;
    }
    let (first, last) = (0..third, r.rounds - third..r.rounds);
    let _ = writeln!(o, "\nThe pods live through the run, and churn leaves state in them: every closed connection's socket in TIME_WAIT for 60 s and, under iptables and nftables, its conntrack entries for `nf_conntrack_tcp_timeout_time_wait` (see the conditions). Churn rates in the first and the last {third} rounds, beside the modes that ran in the same rounds:\n");
    let _ = writeln!(
        o,
        "| workload | mode | rounds {}..{} | rounds {}..{} | last vs first |",
        first.start,
        first.end - 1,
        last.start,
        last.end - 1
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    for cell in r.cells.iter().filter(|c| c.cell.workload == Workload::Crr) {
        for mode in MODES {
            let (a, b) = (
                rate_in(cell, mode, first.clone()),
                rate_in(cell, mode, last.clone()),
            );
            let _ = writeln!(
                o,
                "| {} | {} | {a:.0} ops/s | {b:.0} ops/s | {} |",
                cell.label,
                mode_name(mode),
                ratio(b, a)
            );
        }
    }
}

/// New connections a second a pod sustains to one destination when each holds `per_connection`
/// of its ports for the `TIME_WAIT` minute.
fn sustained(ports: u32, per_connection: f64) -> f64 {
    if per_connection > 0.0 {
        f64::from(ports) / TIME_WAIT_SECONDS / per_connection
    } else {
        0.0
    }
}

/// The ports a connection holds in each mode, and the churn to one destination they allow.
fn port_budget(o: &mut String, r: &RealProxyResults) {
    let Some(ports) = ephemeral_ports(r) else {
        return;
    };
    let _ = writeln!(o, "\n## Churn to one destination, sustained\n");
    let _ = writeln!(
        o,
        "Under the kernel's default `net.ipv4.tcp_tw_reuse` ({}), a port held in TIME_WAIT is reused only for loopback connections, and a closed connection holds its port for {TIME_WAIT_SECONDS:.0} s, which no setting changes. A pod therefore has {ports} ports (`ip_local_port_range` {}) per {TIME_WAIT_SECONDS:.0} s toward any one destination: a pod that opens connections to one destination faster than they allow waits for ports (each connect searching the range for one whose TIME_WAIT has ended), however fast the path. How many ports each connection holds was counted in each pod after a churn run of its own (one client, no warm-up) to a destination nothing else had dialled: the pod's sockets in TIME_WAIT toward it, per connection made.\n",
        sysctl(r, "net.ipv4.tcp_tw_reuse").unwrap_or("?"),
        sysctl(r, "net.ipv4.ip_local_port_range").unwrap_or("?"),
    );
    let _ = writeln!(o, "| mode | connections | TIME_WAIT toward the destination | ports per connection | sustained new connections/s to one destination | vs no mesh | vs iptables |");
    let _ = writeln!(o, "|---|---|---|---|---|---|---|");
    let rate = |mode: Mode| {
        r.ports_held
            .iter()
            .find(|(m, _)| *m == mode)
            .map_or(0.0, |(_, p)| sustained(ports, p.per_connection()))
    };
    for (mode, held) in &r.ports_held {
        let this = rate(*mode);
        let _ = writeln!(
            o,
            "| {} | {} | {} | {:.2} | {this:.0} | {} | {} |",
            mode_name(*mode),
            held.connections,
            held.time_wait,
            held.per_connection(),
            if *mode == Mode::None {
                String::new()
            } else {
                ratio(this, rate(Mode::None))
            },
            if matches!(mode, Mode::Nftables | Mode::Ebpf) {
                ratio(this, rate(Mode::Iptables))
            } else {
                String::new()
            },
        );
    }
    let _ = writeln!(o, "\nThe sustained rate is {ports} / {TIME_WAIT_SECONDS:.0} s / ports per connection: over any minute of churn beyond it, each port serves one connection. With a proxy, its connection to the destination holds a port (the proxy closes it, after the app closed its own); without a mesh, the app's own connection does. Under iptables and nftables the app's socket stays connected to the destination's address (NAT rewrites its packets, not the socket), so its TIME_WAIT holds a port toward the destination too; under ebpf it is connected to the proxy over loopback, where TIME_WAIT does not keep ports from reuse.");
    let conntrack: Vec<String> = MODES
        .iter()
        .filter_map(|m| {
            let entries = r.cells.iter().rev().find_map(|c| {
                c.aftermath
                    .iter()
                    .find(|(mode, _)| mode == m)
                    .map(|(_, a)| a.conntrack)
            })?;
            Some(format!("{} {entries}", mode_name(*m)))
        })
        .collect();
    if !conntrack.is_empty() {
        let _ = writeln!(o, "\nConntrack entries in each pod's netns after its last churn sample: {}. The NAT of iptables and nftables needs conntrack, which then tracks every connection in the pod, the proxy's to the destination too, and looks up every packet; the ebpf and no-mesh pods have no rule that needs it and track nothing.", conntrack.join(", "));
    }
}

fn conditions(o: &mut String, r: &RealProxyResults) {
    let _ = writeln!(o, "\n## Conditions\n");
    let _ = writeln!(
        o,
        "- Machine: {}, {} CPUs, kernel {}. Other work may have run on the machine meanwhile; the modes are interleaved and medians taken so that it weighs on every mode alike, and pod CPU does not count it.",
        if r.cpu_model.is_empty() { "CPU model unknown" } else { &r.cpu_model },
        r.cpus,
        r.kernel
    );
    let _ = writeln!(
        o,
        "- {} rounds; in each, every workload runs in every mode for {} s after {} s of warm-up (discarded), the modes' order rotating from round to round and workload to workload. The pods, and HAProxy in them, live through the whole run.",
        r.rounds, r.seconds_per_sample, r.warmup_seconds
    );
    let _ = writeln!(
        o,
        "- {}",
        if r.one_client_on_one_cpu {
            "One-client workloads run the app, HAProxy and the upstream on one CPU, the same in every mode (as the synthetic benchmark does: left to the scheduler, where the processes of one request land moves the rate more than capture does); the eight-client workload uses every CPU."
        } else {
            "Every process may run on every CPU."
        }
    );
    let _ = writeln!(
        o,
        "- {}, as Debian ships it (\"{}\"), run in the pod as uid/gid 1337 with an open-files limit of {} (its default maxconn follows from it) and this configuration, nothing else set (so its defaults: as many threads as CPUs, no logging):\n",
        r.haproxy_version, r.haproxy_threads, r.open_files_limit
    );
    let _ = writeln!(o, "```\n{}```\n", r.haproxy_config);
    let _ = writeln!(
        o,
        "- The pods' sysctls, untouched: the kernel's defaults for a new netns, and the node's conntrack table:\n"
    );
    let _ = writeln!(o, "| sysctl | value |\n|---|---|");
    for (k, v) in &r.sysctls {
        let _ = writeln!(o, "| {k} | {v} |");
    }
}

/// Writes real-proxy.md and real-proxy.json into `dir`.
pub fn write(r: &RealProxyResults, dir: &Path) {
    crate::report::write_json_and_markdown(
        r,
        dir,
        "real-proxy.json",
        ("real-proxy.md", &markdown(r)),
    );
}

#[cfg(test)]
mod tests {
    use super::{
        super::{cells, PortsHeld},
        *,
    };
    use capture_tests::haproxy::default_sidecar_config;

    use crate::{roles::LoadResult, Sample};

    fn sample(round: usize, mode: Mode, ops: u64) -> Sample {
        Sample {
            round,
            mode,
            load: LoadResult {
                ops,
                seconds: 1.0,
                p50_us: 100.0,
                ..LoadResult::default()
            },
            cpu_us_per_op: 50.0,
            pod_cpu_us_per_op: 40.0,
        }
    }

    fn results() -> RealProxyResults {
        let cells = cells()
            .into_iter()
            .map(|cell| CellResult {
                label: cell.label(),
                cell,
                samples: (0..3)
                    .flat_map(|round| {
                        [
                            sample(round, Mode::None, 4000),
                            sample(round, Mode::Iptables, 1000),
                            sample(round, Mode::Nftables, 1000 + 100 * round as u64),
                            sample(round, Mode::Ebpf, 2000),
                        ]
                    })
                    .collect(),
                aftermath: Vec::new(),
            })
            .collect();
        RealProxyResults {
            kernel: "6.1.0".into(),
            cpu_model: "Test CPU".into(),
            cpus: 2,
            quick: false,
            rounds: 3,
            seconds_per_sample: 1.0,
            warmup_seconds: 0.2,
            one_client_on_one_cpu: true,
            haproxy_version: "HAProxy version 2.6.12".into(),
            haproxy_threads: "Built with multi-threading support (MAX_THREADS=64, default=2)."
                .into(),
            haproxy_config: default_sidecar_config(),
            open_files_limit: 1024,
            sysctls: vec![
                ("net.ipv4.tcp_tw_reuse".into(), "2".into()),
                ("net.ipv4.ip_local_port_range".into(), "32768 60999".into()),
            ],
            cells,
            ports_held: [
                (Mode::None, 1000),
                (Mode::Iptables, 2000),
                (Mode::Ebpf, 1001),
            ]
            .map(|(mode, time_wait)| {
                (
                    mode,
                    PortsHeld {
                        connections: 1000,
                        time_wait,
                    },
                )
            })
            .to_vec(),
        }
    }

    #[test]
    fn the_report_gives_each_mode_against_no_mesh_and_iptables_and_its_conditions() {
        let md = markdown(&results());
        assert!(
            md.contains("| outbound connect+rr+close c1 (haproxy) | ebpf | 2000 ops/s | 2000..2000 | 100 | 0 | 40.0 | 50.0 | 0 | 0.50x | 0.50x (0.50..0.50) | 2.00x | 2.00x (2.00..2.00) |"),
            "{md}"
        );
        assert!(
            md.contains("| outbound persistent rr c1 (haproxy) | no mesh | 4000 ops/s |"),
            "{md}"
        );
        assert!(
            md.contains("| nftables | 1100 ops/s | 1000..1200 |")
                && md.contains("| 1.10x | 1.10x (1.00..1.20) |"),
            "{md}"
        );
        assert!(
            md.contains("| iptables | 1000 | 2000 | 2.00 | 235 | 0.50x |  |")
                && md.contains("| ebpf | 1000 | 1001 | 1.00 | 470 | 1.00x | 2.00x |"),
            "{md}"
        );
        assert!(
            md.contains("- connect+rr+close to one destination, sustained: no mesh 471 connections/s, iptables 235 connections/s, ebpf 470 connections/s"),
            "{md}"
        );
        assert!(md.contains("has 28232 ports"), "{md}");
        assert!(
            md.contains("| rounds 0..0 | rounds 2..2 | last vs first |")
                && md.contains("| outbound connect+rr+close c8 (haproxy) | nftables | 1000 ops/s | 1200 ops/s | 1.20x |"),
            "{md}"
        );
        assert!(md.contains("server original 0.0.0.0:0"), "{md}");
        assert!(md.contains("| net.ipv4.tcp_tw_reuse | 2 |"), "{md}");
        assert!(md.contains("Test CPU, 2 CPUs, kernel 6.1.0"), "{md}");
        assert!(
            md.contains("- outbound connect+rr+close c1 (haproxy): ebpf 2000 ops/s, 2.00x iptables and 0.50x no mesh (per round 2.00x and 0.50x)"),
            "{md}"
        );
    }
}
