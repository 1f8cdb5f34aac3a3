//! `capture-bench`: the benchmark driver (`run`) and its roles (`role …`, run inside pods).

use std::{net::SocketAddr, path::PathBuf, time::Duration};

use capture_bench::{self as bench, roles};
use clap::{Parser, Subcommand};

#[derive(Parser)]
struct Args {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Run the benchmark and write results.json, benchmarks.md and benchmarks.svg.
    Run {
        /// A short run (under two minutes) for a quick check.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
        /// Only the workloads whose label contains this text, and no attach or CNI measurements.
        #[arg(long)]
        focus: Option<String>,
        /// Only these modes (comma-separated).
        #[arg(long, value_enum, value_delimiter = ',')]
        modes: Vec<bench::Mode>,
        /// Rounds (default 5, quick 3).
        #[arg(long)]
        rounds: Option<usize>,
        /// Let one-client runs use every CPU too (by default the load generator, the proxy and
        /// the upstream of a one-client run share one CPU, in every mode).
        #[arg(long)]
        any_cpu: bool,
    },
    /// Write benchmarks.md and benchmarks.svg again from a run's results.json, with this build's
    /// report (no measurement).
    Report {
        /// A results.json written by `run`.
        results: PathBuf,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
    },
    /// Churn and request/response end to end with HAProxy as the sidecar, against no mesh;
    /// writes real-proxy.md and real-proxy.json.
    RealProxy {
        /// A short run (about a minute) for a quick check.
        #[arg(long)]
        quick: bool,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
        /// Rounds (default 25, quick 3).
        #[arg(long)]
        rounds: Option<usize>,
    },
    /// Write real-proxy.md again from a run's real-proxy.json, with this build's report (no
    /// measurement).
    RealProxyReport {
        /// A real-proxy.json written by `real-proxy`.
        results: PathBuf,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
    },
    /// Measure the CPU of one reconcile pass over a synthetic node; writes reconcile-cost.md.
    ReconcileCost {
        #[arg(long, default_value_t = 1000)]
        sandboxes: usize,
        #[arg(long, default_value_t = 20)]
        rounds: usize,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
    },
    /// A node of many captured pods: ADD time from the first to the last, memory per pod, a
    /// reconcile pass, and the next build's takeover under traffic; writes node-scale.md.
    NodeScale {
        #[arg(long, default_value_t = 1000)]
        pods: usize,
        /// The next build's `capture` (`cargo xtask bench --node-scale` builds it).
        #[arg(long, env = "CAPTURE_VARIANT_BIN")]
        variant: PathBuf,
        #[arg(long, default_value = "target/bench")]
        out: PathBuf,
    },
    /// CNI ADD latency alone, as the full run measures it: a burst of pods per agent mode, one
    /// ADD at a time and several at once. Prints the table and the targets.
    CniAdd {
        #[arg(long, default_value_t = 100)]
        pods: usize,
        /// Agent modes (comma-separated).
        #[arg(long, value_delimiter = ',', default_values_t = bench::cni_add::MODES.map(String::from))]
        modes: Vec<String>,
        /// ADDs in flight at once, one run each (comma-separated).
        #[arg(long, value_delimiter = ',', default_values_t = [1, bench::cni_add::BURST])]
        concurrent: Vec<usize>,
        /// Rounds of each (mode, ADDs at once), interleaved.
        #[arg(long, default_value_t = bench::cni_add::ROUNDS)]
        rounds: usize,
    },
    /// One process of the benchmark, entered into a pod.
    Role {
        #[arg(long)]
        netns: PathBuf,
        #[arg(long)]
        cgroup: Option<PathBuf>,
        #[arg(long)]
        uid: u32,
        #[arg(long)]
        gid: u32,
        #[command(subcommand)]
        what: Role,
    },
}

#[derive(Subcommand)]
enum Role {
    Echo {
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
    },
    Forward {
        #[arg(long)]
        listen: SocketAddr,
        #[arg(long)]
        default_upstream: SocketAddr,
    },
    Load {
        #[arg(long, value_enum)]
        workload: roles::Workload,
        #[arg(long)]
        target: SocketAddr,
        #[arg(long)]
        concurrency: usize,
        #[arg(long)]
        warmup_ms: u64,
        #[arg(long)]
        duration_ms: u64,
    },
}

#[expect(
    clippy::too_many_lines,
    reason = "one arm per benchmark command, each beside the arguments it reads"
)]
fn main() {
    bench::scratch_on_tmpfs();
    match Args::parse().cmd {
        Cmd::RealProxy { quick, out, rounds } => {
            let results = bench::real_proxy::run(&bench::real_proxy::Options {
                quick,
                out: out.clone(),
                rounds,
            });
            print!("{}", bench::real_proxy::markdown(&results));
            println!("wrote {}", out.display());
        }
        Cmd::RealProxyReport { results, out } => {
            let text = std::fs::read_to_string(&results)
                .unwrap_or_else(|e| panic!("read {}: {e}", results.display()));
            let results: bench::real_proxy::RealProxyResults = serde_json::from_str(&text)
                .unwrap_or_else(|e| {
                    panic!(
                        "{} is not a real-proxy.json of this build's format: {e}",
                        results.display()
                    )
                });
            bench::real_proxy::write(&results, &out);
            println!("wrote {}", out.display());
        }
        Cmd::NodeScale { pods, variant, out } => {
            let r = bench::node_scale::run(pods, &variant, &out);
            print!("{}", bench::node_scale::markdown(&r));
            for (what, ok) in bench::node_scale::targets(&r) {
                println!("[{}] {what}", if ok { "met" } else { "NOT met" });
            }
            println!("wrote {}", out.join("node-scale.md").display());
        }
        Cmd::ReconcileCost {
            sandboxes,
            rounds,
            out,
        } => {
            let cost = bench::reconcile_cost::measure(sandboxes, rounds);
            let text = bench::reconcile_cost::markdown(&cost);
            std::fs::create_dir_all(&out).expect("the output directory");
            std::fs::write(out.join("reconcile-cost.md"), &text).expect("reconcile-cost.md");
            print!("{text}");
        }
        Cmd::CniAdd {
            pods,
            modes,
            concurrent,
            rounds,
        } => {
            let runs = bench::cni_add::measure(&modes, pods, &concurrent, rounds);
            let mut text = String::new();
            bench::cni_add::write_table(&mut text, &runs);
            print!("{text}");
            for (what, ok) in bench::cni_add::targets(&runs) {
                println!("[{}] {what}", if ok { "met" } else { "NOT met" });
            }
        }
        Cmd::Run {
            quick,
            out,
            focus,
            modes,
            rounds,
            any_cpu,
        } => {
            let focused = focus.is_some();
            let results = bench::run(&bench::Options {
                quick,
                out: out.clone(),
                focus,
                modes,
                rounds,
                any_cpu,
            });
            if focused {
                // The targets judge a full run; a focused one says what it measured.
                for cell in &results.cells {
                    let mut printed_ebpf = false;
                    let none = bench::report::summarize(cell, bench::Mode::None).rate;
                    for mode in bench::Mode::ALL.into_iter().chain(bench::Mode::TRACE_COST) {
                        let s = bench::report::summarize(cell, mode);
                        if s.rate > 0.0 && !(mode == bench::Mode::Ebpf && printed_ebpf) {
                            printed_ebpf |= mode == bench::Mode::Ebpf;
                            let per_round = bench::report::paired(cell, mode, bench::Mode::None)
                                .filter(|_| mode != bench::Mode::None)
                                .map_or(String::new(), |p| {
                                    format!(
                                        "; per round {:.2}x ({:.2}..{:.2}, {} rounds)",
                                        p.median, p.min, p.max, p.rounds
                                    )
                                });
                            let vs_none = if none > 0.0 {
                                format!(", {:.2}x none", s.rate / none)
                            } else {
                                String::new()
                            };
                            println!(
                                "{}: {} median {:.0}/s ({:.0}..{:.0}){vs_none}{per_round}; CPU {:.1} µs/op",
                                cell.label,
                                mode.name(),
                                s.rate,
                                s.rate_min,
                                s.rate_max,
                                s.cpu
                            );
                        }
                    }
                }
            } else {
                for (what, ok) in bench::report::targets(&results) {
                    println!("[{}] {what}", if ok { "met" } else { "NOT met" });
                }
            }
            println!("wrote {}", out.display());
        }
        Cmd::Report { results, out } => {
            let text = std::fs::read_to_string(&results)
                .unwrap_or_else(|e| panic!("read {}: {e}", results.display()));
            let results: bench::Results = serde_json::from_str(&text).unwrap_or_else(|e| {
                panic!(
                    "{} is not a results.json of this build's format: {e}",
                    results.display()
                )
            });
            bench::report::write(&results, &out);
            println!("wrote {}", out.display());
        }
        Cmd::Role {
            netns,
            cgroup,
            uid,
            gid,
            what,
        } => {
            capture_tests::enter::join_pod(cgroup.as_deref(), Some(&netns)).expect("enter the pod");
            capture_tests::enter::become_ids(uid, gid, &[]).expect("become the role's identity");
            match what {
                Role::Echo { listen } => roles::echo(&listen, 8),
                Role::Forward {
                    listen,
                    default_upstream,
                } => roles::forward(listen, default_upstream, 8),
                Role::Load {
                    workload,
                    target,
                    concurrency,
                    warmup_ms,
                    duration_ms,
                } => {
                    let r = roles::load(
                        workload,
                        target,
                        concurrency,
                        Duration::from_millis(warmup_ms),
                        Duration::from_millis(duration_ms),
                    );
                    println!("{}", serde_json::to_string(&r).expect("serialise"));
                }
            }
        }
    }
}
