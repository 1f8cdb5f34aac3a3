//! The benchmark's outputs: results.json (every sample), benchmarks.md (medians, spread, ratios,
//! the targets) and benchmarks.svg (throughput relative to no capture).

use std::{fmt::Write as _, path::Path};

pub use super::stats::{paired, summarize, Paired, Summary};
pub use super::targets::targets;
use super::{
    roles::Workload,
    stats::{median, ratio, scale_points},
    CellResult, Mode, Results, Settings,
};

fn unit(cell: &CellResult) -> &'static str {
    if cell.cell.workload == Workload::Stream {
        "MB/s"
    } else {
        "ops/s"
    }
}

/// The markdown report.
#[must_use]
#[expect(
    clippy::too_many_lines,
    reason = "the report's sections, in the order they are printed"
)]
pub fn markdown(r: &Results) -> String {
    let mut o = String::new();
    let _ = writeln!(o, "# Benchmarks\n");
    let _ = writeln!(
        o,
        "Produced by `cargo xtask bench{}` on kernel {}, {} CPUs: {} rounds of {:.1} s per sample, the {} modes interleaved (their order rotates every round), warm-up discarded. Medians over rounds; the range is min..max. \"vs none\" divides two such medians; \"vs none, per round\" divides the mode's rate by none's in the same round (seconds apart) and gives the median and range of those ratios, which the machine's drift over minutes moves less. CPU is the whole machine's busy time per operation (from /proc/stat), so it includes the proxy and the client.{}\n",
        if r.quick { " --quick" } else { "" },
        r.kernel,
        r.cpus,
        r.rounds,
        r.seconds_per_sample,
        Mode::ALL.len(),
        if r.one_client_on_one_cpu {
            " One-client cells run the load generator, the proxy and the upstream on one CPU, the same in every mode: left to the scheduler, whether they shared a CPU or woke the other one moved a mode's rate by up to half from one sample to the next."
        } else {
            " Every process may run on every CPU."
        }
    );
    let _ = writeln!(o, "![throughput relative to no capture](benchmarks.svg)\n");
    let _ = writeln!(o, "## Under the kernel's default settings\n");
    let _ = writeln!(o, "The headline: what a node running the kernel's defaults gets. `net.ipv4.tcp_tw_reuse` is 2 there, which reuses a port held in TIME_WAIT only for loopback connections. Without capture, and with ebpf capture (which rewrites the destination before a port is chosen), the app's connections go to a loopback address; with iptables capture the app's socket stays connected to the remote address, so its closed connections hold their ports for a minute and connection churn runs out of ephemeral ports.\n");
    table(&mut o, r, Settings::Default);
    let _ = writeln!(o, "\n## Tuned for connection churn\n");
    let _ = writeln!(o, "The same churn workloads in pods with `net.ipv4.tcp_tw_reuse=1` and `net.ipv4.ip_local_port_range=1024 65000`, so that no mode runs out of ports: what each mode costs once ports are not the limit.\n");
    table(&mut o, r, Settings::Tuned);
    let _ = writeln!(o, "\n## What churn leaves behind\n");
    let _ = writeln!(o, "Sockets in TIME_WAIT and conntrack entries in the pod's netns right after each churn cell's last sample.\n");
    let _ = writeln!(
        o,
        "| workload | {} |",
        Mode::ALL
            .map(|m| format!("{} TIME_WAIT / conntrack", m.name()))
            .join(" | ")
    );
    let _ = writeln!(o, "|---|{}", "---|".repeat(Mode::ALL.len()));
    for cell in r.cells.iter().filter(|c| !c.aftermath.is_empty()) {
        let cols: Vec<String> = Mode::ALL
            .iter()
            .map(|m| {
                cell.aftermath
                    .iter()
                    .find(|(mode, _)| mode == m)
                    .map_or("-".into(), |(_, a)| {
                        format!("{} / {}", a.time_wait, a.conntrack)
                    })
            })
            .collect();
        let _ = writeln!(o, "| {} | {} |", cell.label, cols.join(" | "));
    }
    let _ = writeln!(
        o,
        "\nConntrack entries left in each pod after the echo runs: {}.\n",
        r.conntrack_entries
            .iter()
            .map(|(m, n)| format!("{} {n}", m.name()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let _ = writeln!(o, "## Acceleration on this kernel\n");
    if r.accel.differences.is_empty() {
        let _ = writeln!(o, "The acceleration's {} correctness checks found no difference on this kernel: the agent's `--accelerate` would accelerate pods that ask.\n", r.accel.cases);
    } else {
        let _ = writeln!(o, "The acceleration's correctness checks found {} difference(s) in {} cases on this kernel: {}. The agent's `--accelerate` therefore accelerates no pod here; the ebpf+accel rows were measured with those differences accepted (`--accelerate-accepting`), to show what acceleration would give and what it would cost.\n", r.accel.differences.len(), r.accel.cases, r.accel.differences.join(", "));
    }
    let _ = writeln!(o, "## Attaching pods\n");
    let _ = writeln!(
        o,
        "| backend | pods | p50 ms | pod 10 ms | last pods ms | kernel memory per pod |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|---|");
    for a in &r.attach {
        let (p10, last) = scale_points(&a.latencies_ms);
        let _ = writeln!(
            o,
            "| {} | {} | {:.2} | {:.2} | {:.2} | {:.1} KiB |",
            a.mode,
            a.pods,
            median(a.latencies_ms.clone()),
            p10,
            last,
            a.kib_per_pod
        );
    }
    let _ = writeln!(o, "\nAttach latency is `capture attach` end to end (a process per pod: parse, open the netns and cgroup, load-or-adopt, link, record), without the agent; the agent's path is the CNI ADD table below. Kernel memory per pod is the growth of unreclaimable kernel memory (SUnreclaim + Percpu + VmallocUsed in /proc/meminfo) from the first pod to the last, divided by the pods after the first: the first pays the node's one-time program load. It is machine-wide, so other activity on the node shows up in it.\n");
    crate::cni_add::write_table(&mut o, &r.cni_add);
    let _ = writeln!(o, "## Where the ebpf path spends its time\n");
    let _ = writeln!(
        o,
        "In-kernel run time of the capture programs in a separate pass of {} connections (outbound connect+rr+close, one client, echo proxy, kernel.bpf_stats_enabled on for that pass only). The kernel's accounting adds two clock reads to every run, so these are upper bounds. Programs that did not run are left out.\n",
        r.profiled_connections
    );
    let _ = writeln!(o, "| program | runs | ns per run | runs per connection |");
    let _ = writeln!(o, "|---|---|---|---|");
    let mut per_conn_ns = 0.0;
    for p in &r.program_costs {
        let per = ratio(p.runs as f64, r.profiled_connections as f64);
        per_conn_ns += per * p.ns_per_run;
        let _ = writeln!(
            o,
            "| {} | {} | {:.0} | {:.2} |",
            p.program, p.runs, p.ns_per_run, per
        );
    }
    let _ = writeln!(
        o,
        "\nTotal: about {:.2} µs of program time per connection.\n",
        per_conn_ns / 1000.0
    );
    if !r.accel_program_costs.is_empty() {
        let _ = writeln!(o, "## Where the ebpf+accel path spends its time\n");
        let _ = writeln!(
            o,
            "The same accounting over {} requests of outbound persistent request/response (echo proxy) in the ebpf+accel pod: the sk_msg program runs once per write of either socket, in place of the loopback TCP stack's transmit and receive paths.\n",
            r.accel_profiled_requests
        );
        let _ = writeln!(o, "| program | runs | ns per run | runs per request |");
        let _ = writeln!(o, "|---|---|---|---|");
        for p in &r.accel_program_costs {
            let _ = writeln!(
                o,
                "| {} | {} | {:.0} | {:.2} |",
                p.program,
                p.runs,
                p.ns_per_run,
                ratio(p.runs as f64, r.accel_profiled_requests as f64)
            );
        }
        let _ = writeln!(o);
    }
    let _ = writeln!(o, "## Tracing\n");
    let _ = writeln!(o, "What `capture trace` costs (the programs with tracing built in and off against the same build without it, and with the pod traced) is measured by `cargo xtask bench --trace-cost`, interleaved in one run of its own: [trace-cost.md](trace-cost.md).\n");
    let _ = writeln!(o, "## Reconcile\n");
    let _ = writeln!(o, "The CPU of one pass of the agent's reconcile with the container runtime over a node of 1,000 pod sandboxes is measured by `cargo xtask bench --reconcile-cost`: [reconcile-cost.md](reconcile-cost.md).\n");
    let _ = writeln!(o, "## Targets\n");
    for (what, ok) in targets(r) {
        let _ = writeln!(o, "- [{}] {what}", if ok { "x" } else { " " });
    }
    o
}

/// One table of cells under `settings`.
fn table(o: &mut String, r: &Results, settings: Settings) {
    let _ = writeln!(o, "| workload | mode | rate | range | p50 µs | p99 µs | p99.9 µs | CPU µs/op | vs none | vs none, per round | vs iptables |");
    let _ = writeln!(o, "|---|---|---|---|---|---|---|---|---|---|---|");
    for cell in r.cells.iter().filter(|c| c.cell.settings == settings) {
        let none = summarize(cell, Mode::None);
        let ipt = summarize(cell, Mode::Iptables);
        for mode in Mode::ALL {
            let s = summarize(cell, mode);
            let vs_ipt = matches!(mode, Mode::Nftables | Mode::Ebpf | Mode::EbpfAccel);
            let _ = writeln!(
                o,
                "| {} | {} | {:.0} {} | {:.0}..{:.0} | {:.0} | {:.0} | {:.0} | {:.1} | {:.2}x | {} | {} |",
                cell.label,
                mode.name(),
                s.rate,
                unit(cell),
                s.rate_min,
                s.rate_max,
                s.p50,
                s.p99,
                s.p999,
                s.cpu,
                ratio(s.rate, none.rate),
                match paired(cell, mode, Mode::None) {
                    Some(p) if mode != Mode::None => {
                        format!("{:.2}x ({:.2}..{:.2})", p.median, p.min, p.max)
                    }
                    _ => String::new(),
                },
                if vs_ipt { format!("{:.2}x", ratio(s.rate, ipt.rate)) } else { String::new() }
            );
        }
    }
}

/// Throughput of each mode relative to no capture, one group of bars per workload.
#[must_use]
#[expect(
    clippy::many_single_char_names,
    reason = "SVG geometry: x, y, w, h as the format names them"
)]
pub fn svg(r: &Results) -> String {
    let (w, row_h, left) = (800.0, 62.0, 330.0);
    let h = 60.0 + row_h * r.cells.len() as f64 * 1.0 + 30.0;
    let mut o = format!("<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" font-family=\"sans-serif\" font-size=\"11\">\n");
    let _ = writeln!(o, "<text x=\"10\" y=\"20\" font-size=\"14\">Throughput relative to no capture (1.0 = the limit)</text>");
    let colors = [
        (Mode::Iptables, "#d62728"),
        (Mode::Nftables, "#ff7f0e"),
        (Mode::Ebpf, "#1f77b4"),
        (Mode::EbpfAccel, "#2ca02c"),
        (Mode::EbpfIdentity, "#9467bd"),
    ];
    for (i, (m, c)) in colors.iter().enumerate() {
        let _ = writeln!(o, "<rect x=\"{}\" y=\"30\" width=\"10\" height=\"10\" fill=\"{c}\"/><text x=\"{}\" y=\"39\">{}</text>", 10.0 + i as f64 * 110.0, 24.0 + i as f64 * 110.0, m.name());
    }
    let scale = (w - left - 40.0) / 1.6;
    let x1 = left + scale;
    let _ = writeln!(o, "<line x1=\"{x1}\" y1=\"45\" x2=\"{x1}\" y2=\"{}\" stroke=\"#888\" stroke-dasharray=\"4\"/>", h - 20.0);
    for (row, cell) in r.cells.iter().enumerate() {
        let y = 55.0 + row as f64 * row_h;
        let none = summarize(cell, Mode::None).rate;
        let _ = writeln!(o, "<text x=\"5\" y=\"{}\">{}</text>", y + 14.0, cell.label);
        for (k, (m, c)) in colors.iter().enumerate() {
            let rel = ratio(summarize(cell, *m).rate, none).min(1.6);
            let _ = writeln!(
                o,
                "<rect x=\"{left}\" y=\"{}\" width=\"{:.1}\" height=\"10\" fill=\"{c}\"/><text x=\"{:.1}\" y=\"{}\">{rel:.2}</text>",
                y + k as f64 * 11.0,
                rel * scale,
                left + rel * scale + 3.0,
                y + 9.0 + k as f64 * 11.0
            );
        }
    }
    o.push_str("</svg>\n");
    o
}

/// Writes the results as `json` and a report of them as `md` (file names) into `dir`.
pub fn write_json_and_markdown(
    r: &impl serde::Serialize,
    dir: &Path,
    json: &str,
    md: (&str, &str),
) {
    std::fs::create_dir_all(dir).expect("output directory");
    std::fs::write(
        dir.join(json),
        serde_json::to_vec_pretty(r).expect("serialise"),
    )
    .expect(json);
    std::fs::write(dir.join(md.0), md.1).expect(md.0);
}

/// Writes results.json, benchmarks.md and benchmarks.svg into `dir`.
pub fn write(r: &Results, dir: &Path) {
    write_json_and_markdown(r, dir, "results.json", ("benchmarks.md", &markdown(r)));
    std::fs::write(dir.join("benchmarks.svg"), svg(r)).expect("benchmarks.svg");
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{roles::LoadResult, AttachScale, Cell, CellResult, Proxy, Sample};

    fn sample(round: usize, mode: Mode, ops: u64, cpu: f64) -> Sample {
        Sample {
            round,
            mode,
            load: LoadResult {
                ops,
                seconds: 1.0,
                p50_us: 10.0,
                ..LoadResult::default()
            },
            cpu_us_per_op: cpu,
            pod_cpu_us_per_op: 0.0,
        }
    }

    fn results() -> Results {
        let cell = Cell {
            workload: Workload::Crr,
            concurrency: 8,
            inbound: false,
            proxy: Proxy::Echo,
            settings: Settings::Default,
            family: super::super::Family::Ipv4,
        };
        let samples = vec![
            sample(0, Mode::None, 1000, 10.0),
            sample(1, Mode::None, 3000, 10.0),
            sample(2, Mode::None, 2000, 10.0),
            sample(0, Mode::Iptables, 500, 20.0),
            sample(1, Mode::Iptables, 700, 20.0),
            sample(2, Mode::Iptables, 600, 20.0),
            sample(0, Mode::Ebpf, 1900, 12.0),
            sample(1, Mode::Ebpf, 2000, 12.0),
            sample(2, Mode::Ebpf, 2100, 12.0),
        ];
        Results {
            kernel: "test".into(),
            cpus: 2,
            quick: true,
            rounds: 3,
            seconds_per_sample: 1.0,
            one_client_on_one_cpu: true,
            cells: vec![CellResult {
                label: cell.label(),
                cell,
                samples,
                aftermath: vec![(
                    Mode::Iptables,
                    crate::Aftermath {
                        time_wait: 28000,
                        conntrack: 5,
                    },
                )],
            }],
            conntrack_entries: vec![(Mode::Iptables, 42)],
            program_costs: vec![crate::ProgramCost {
                program: "capture_connect4".into(),
                runs: 6000,
                ns_per_run: 500.0,
            }],
            profiled_connections: 6000,
            attach: vec![AttachScale {
                mode: "ebpf".into(),
                pods: 100,
                latencies_ms: (0..100).map(|i| 1.0 + f64::from(i) / 1000.0).collect(),
                kib_per_pod: 10.0,
            }],
            cni_add: vec![crate::cni_add::CniAdd {
                mode: "ebpf".into(),
                pods: 100,
                concurrent: 1,
                rounds: vec![
                    (1..=100).map(f64::from).collect(),
                    (1..=100).map(|ms| f64::from(ms) / 50.0).collect(),
                    (1..=100).map(|ms| f64::from(ms) * 2.0).collect(),
                ],
            }],
            accel: crate::AccelNote {
                differences: vec!["so_rcvlowat".into()],
                cases: 22,
            },
            accel_program_costs: Vec::new(),
            accel_profiled_requests: 0,
        }
    }

    #[test]
    fn medians_ratios_and_targets() {
        let mut r = results();
        // An IPv6-only pod's churn first, at half the rate: the IPv4 targets do not read it.
        let mut v6 = r.cells[0].clone();
        v6.cell.family = crate::Family::Ipv6Only;
        v6.label = v6.cell.label();
        for s in v6.samples.iter_mut().filter(|s| s.mode == Mode::Ebpf) {
            s.load.ops /= 2;
        }
        r.cells.insert(0, v6);
        let none = summarize(&r.cells[1], Mode::None);
        assert!(
            (none.rate - 2000.0).abs() < 1e-9
                && (none.rate_min - 1000.0).abs() < 1e-9
                && (none.rate_max - 3000.0).abs() < 1e-9
        );
        let t = targets(&r);
        let find = |needle: &str| {
            t.iter()
                .find(|(w, _)| w.contains(needle))
                .unwrap_or_else(|| panic!("{needle} in {t:?}"))
                .1
        };
        assert!(
            find("connection rate ≥ 0.97x"),
            "2000/2000 and per round 1.05 ≥ 0.97"
        );
        assert!(
            !find("IPv6 connection rate ≥ 1.0x no capture (outbound connect+rr+close c8 (echo proxy, IPv6-only pod))"),
            "per round 0.53x"
        );
        let p = paired(&r.cells[1], Mode::Ebpf, Mode::None).expect("rounds with both modes");
        // Per round: 1900/1000, 2000/3000, 2100/2000.
        assert!(
            (p.median - 1.05).abs() < 1e-9
                && (p.min - 2000.0 / 3000.0).abs() < 1e-9
                && (p.max - 1.9).abs() < 1e-9
                && p.rounds == 3,
            "{p:?}"
        );
        assert_eq!(paired(&r.cells[1], Mode::EbpfAccel, Mode::None), None);
        assert!(find("≥ 2x iptables"), "2000/600 ≥ 2");
        assert!(find("CPU per connection"), "12/20 ≤ 0.8");
        assert!(find("attach p50"));
        assert!(find("within 1.2x"));
        assert!(find("KiB kernel memory"));
        let md = markdown(&r);
        assert!(
            md.contains("| outbound connect+rr+close c8 (echo proxy) | ebpf | 2000 ops/s |")
                && md.contains("| 1.00x | 1.05x (0.67..1.90) | 3.33x |"),
            "{md}"
        );
        assert!(md.contains("iptables 42"));
        assert!(md.contains("on one CPU, the same in every mode"), "{md}");
        let anywhere = markdown(&Results {
            one_client_on_one_cpu: false,
            ..results()
        });
        assert!(anywhere.contains("Every process may run on every CPU."));
        assert!(md.contains("| 28000 / 5 |"), "{md}");
        assert!(
            md.contains("1 difference(s) in 22 cases on this kernel: so_rcvlowat"),
            "{md}"
        );
        assert!(
            md.contains("| ebpf | 1 | 100 × 3 | 50.50 | 99.00 | 100.00 | 1.98 – 198.00 |"),
            "{md}"
        );
        // The median round's p99: 99 ms (the others' are 1.98 and 198 ms).
        assert!(
            !find("CNI ADD p99 ≤ 5 ms, 1 at once: 99.00 ms"),
            "99 ms > 5 ms"
        );
        assert!(
            md.contains("| capture_connect4 | 6000 | 500 | 1.00 |") && md.contains("about 0.50 µs"),
            "{md}"
        );
        let svg = svg(&r);
        assert!(svg.starts_with("<svg") && svg.trim_end().ends_with("</svg>"));
    }
}
