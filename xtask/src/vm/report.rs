//! docs/results/kernel-support.md: which capability works on which kernel, from the results of a
//! run.
//!
//! Capabilities are named by the tests that exercise them; a test may count for several.

use std::{fmt::Write as _, fs, path::Path, process::Command};

use anyhow::{Context as _, Result};

use super::model::{KernelResult, Outcome, TestResult};

/// A row of the table: the tests that show it works, as (binary, test) patterns, where a pattern
/// ending in `*` matches names starting with what precedes it; `except` takes tests out again.
pub struct Capability {
    pub name: &'static str,
    pub tests: &'static [(&'static str, &'static str)],
    pub except: &'static [(&'static str, &'static str)],
}

/// Lifecycle tests that belong to more specific rows.
const LIFECYCLE_ELSEWHERE: &[(&str, &str)] = &[
    (
        "lifecycle",
        "other_getsockopt_calls_keep_the_kernels_answer",
    ),
    (
        "lifecycle",
        "a_process_that_joins_the_cgroup_after_attach_is_captured",
    ),
    (
        "lifecycle",
        "pods_with_colliding_loopback_tuples_keep_their_own_destinations",
    ),
    (
        "lifecycle",
        "a_proxy_started_before_attach_still_learns_the_original_destination",
    ),
];

pub const CAPABILITIES: &[Capability] = &[
    Capability {
        name: "outbound capture (connect → 15001)",
        tests: &[
            ("outbound", "*"),
            (
                "lifecycle",
                "a_process_that_joins_the_cgroup_after_attach_is_captured",
            ),
        ],
        except: &[],
    },
    Capability {
        name: "inbound capture (→ 15006)",
        tests: &[
            ("parity", "default_sidecar_inbound"),
            ("parity", "no_listeners_means_refused_never_bypassed"),
        ],
        except: &[],
    },
    Capability {
        name: "original destination (SO_ORIGINAL_DST, local address, getpeername)",
        tests: &[
            ("outbound", "default_sidecar"),
            ("haproxy", "*"),
            ("parity", "default_sidecar_inbound"),
            (
                "lifecycle",
                "pods_with_colliding_loopback_tuples_keep_their_own_destinations",
            ),
        ],
        except: &[],
    },
    Capability {
        name: "the kernel's getsockopt answers left intact (one larger than a page)",
        tests: &[
            ("sockopt_answers", "*"),
            (
                "lifecycle",
                "other_getsockopt_calls_keep_the_kernels_answer",
            ),
        ],
        except: &[],
    },
    Capability {
        name: "original destination for a proxy started before attach",
        tests: &[(
            "lifecycle",
            "a_proxy_started_before_attach_still_learns_the_original_destination",
        )],
        except: &[],
    },
    Capability {
        name: "kernel probe: every hook loads, verifies and attaches",
        tests: &[(
            "kernel_compat",
            "the_probe_loads_and_attaches_every_hook_and_leaves_nothing",
        )],
        except: &[],
    },
    Capability {
        name: "netns cookie without SO_NETNS_COOKIE (BPF reporter)",
        tests: &[
            (
                "kernel_compat",
                "the_bpf_netns_cookie_reporter_agrees_with_the_kernel",
            ),
            (
                "kernel_compat",
                "the_reporter_answers_from_a_cgroup_namespace_of_its_own",
            ),
        ],
        except: &[],
    },
    Capability {
        name: "port annotations (include/exclude ports, status port)",
        tests: &[
            ("outbound", "exclude_outbound_ports_rank_first"),
            ("outbound", "cni_default_port_exclusion"),
            ("parity", "inbound_exclude_list_and_disabled_inbound"),
            ("parity", "explicit_inbound_include_list_ignores_excludes"),
            (
                "parity",
                "status_port_annotation_moves_the_inbound_exclusion",
            ),
        ],
        except: &[],
    },
    Capability {
        name: "CIDR annotations",
        tests: &[
            ("outbound", "include_outbound_cidrs"),
            ("outbound", "exclude_cidrs_rank_above_include_ports"),
            ("outbound", "loopback_include_cidr_is_captured"),
        ],
        except: &[],
    },
    Capability {
        name: "owner uids/gids",
        tests: &[
            ("outbound", "several_proxy_uids_in_order"),
            ("dns_and_groups", "owner_groups_*"),
        ],
        except: &[],
    },
    Capability {
        name: "DNS capture",
        tests: &[
            ("dns_and_groups", "dns_*"),
            ("dns_and_groups", "a_pod_can_turn_dns_capture_off"),
        ],
        except: &[],
    },
    Capability {
        name: "interfaces (kube-virt, excludeInterfaces)",
        tests: &[("interfaces", "*")],
        except: &[],
    },
    Capability {
        name: "TPROXY inbound",
        tests: &[("tproxy", "*")],
        except: &[],
    },
    Capability {
        name: "iptables backend",
        tests: &[
            (
                "parity",
                "iptables_mode_writes_and_removes_exactly_its_rules",
            ),
            ("parity", "drop_invalid_is_a_mangle_rule_in_iptables_mode"),
            ("cni", "the_agent_in_iptables_mode"),
        ],
        except: &[],
    },
    Capability {
        name: "fallback (auto mode, refusals)",
        tests: &[
            ("cni", "auto_mode_falls_back_per_pod_and_says_so"),
            (
                "kernel_compat",
                "a_pod_needing_a_hook_the_kernel_lacks_falls_back_and_says_which",
            ),
            ("interfaces", "ebpf_mode_refuses_what_it_cannot_capture"),
            ("tproxy", "ebpf_mode_refuses_tproxy"),
        ],
        except: &[],
    },
    Capability {
        name: "lifecycle (attach, detach, idempotence, rollback)",
        tests: &[("lifecycle", "*")],
        except: LIFECYCLE_ELSEWHERE,
    },
    Capability {
        name: "live node (upgrade and rollback, adoption, ownership)",
        tests: &[("upgrade", "*"), ("live_node", "*")],
        except: &[],
    },
    Capability {
        name: "CNI plugin and agent",
        tests: &[
            ("cni", "*"),
            ("cni_defaults", "*"),
            ("coexistence", "*"),
            ("prometheus", "*"),
            ("agent_socket", "*"),
        ],
        except: &[],
    },
    Capability {
        name: "validate",
        tests: &[("validate", "*")],
        except: &[],
    },
    Capability {
        name: "bad input",
        tests: &[("bad_input", "*")],
        except: &[],
    },
    Capability {
        name: "acceleration checks (sk_msg; pods accelerated only where they pass)",
        tests: &[("accel", "*")],
        except: &[],
    },
    Capability {
        name: "IPv4-only pods (dual stack)",
        tests: &[("outbound", "ipv4_only_pod_leaves_ipv6_alone")],
        except: &[],
    },
    Capability {
        name: "nftables backend (its tables; the parity matrix's nftables column is above)",
        tests: &[("nftables", "*")],
        except: &[],
    },
    Capability {
        name: "proxy identity (by container, node policy)",
        tests: &[("proxy_identity", "*"), ("identity_policy", "*")],
        except: &[],
    },
    Capability {
        name: "stateless redirect",
        tests: &[("stateless_redirect", "*")],
        except: &[],
    },
    Capability {
        name: "limits and --max-pods sizing",
        tests: &[("limits", "*"), ("sizing", "*")],
        except: &[],
    },
    Capability {
        name: "trace and explain",
        tests: &[("trace", "*"), ("explain", "*")],
        except: &[],
    },
    Capability {
        name: "pods with a user namespace",
        tests: &[("userns", "*")],
        except: &[],
    },
    Capability {
        name: "multi-network pods (two addresses, two interfaces)",
        tests: &[("multi_network", "*")],
        except: &[],
    },
    Capability {
        name: "cgroup v1 pods (rule backends; ebpf refuses)",
        tests: &[("cgroup_v1", "*")],
        except: &[],
    },
    Capability {
        name: "pods that carry Istio's rules (refuse, take over, adopt)",
        tests: &[("istio_rules", "*")],
        except: &[],
    },
];

fn matches(patterns: &[(&str, &str)], test: &TestResult) -> bool {
    patterns.iter().any(|(binary, pattern)| {
        *binary == test.binary
            && match pattern.strip_suffix('*') {
                Some(prefix) => test.name.starts_with(prefix),
                None => test.name == *pattern,
            }
    })
}

impl Capability {
    fn covers(&self, test: &TestResult) -> bool {
        matches(self.tests, test) && !matches(self.except, test)
    }
}

/// One cell: `FAIL` if any of its tests failed, `pass` if the others passed (noting skips),
/// `skip: reason` if all were skipped, `—` if none ran.
pub fn cell(capability: &Capability, result: &KernelResult) -> String {
    let tests: Vec<&TestResult> = result
        .tests
        .iter()
        .filter(|t| capability.covers(t))
        .collect();
    let count = |o: Outcome| tests.iter().filter(|t| t.outcome == o).count();
    let skip_reason = || {
        tests
            .iter()
            .find(|t| t.outcome == Outcome::Skip)
            .and_then(|t| t.reason.clone())
            .unwrap_or_default()
    };
    match (
        count(Outcome::Fail),
        count(Outcome::Pass),
        count(Outcome::Skip),
    ) {
        (0, 0, 0) => "—".to_string(),
        (0, 0, _) => format!("skip: {}", escape(&skip_reason())),
        (0, _, 0) => "pass".to_string(),
        (0, _, skipped) => format!("pass ({skipped} skipped)"),
        _ => "FAIL".to_string(),
    }
}

/// `text` safe inside a table cell.
fn escape(text: &str) -> String {
    text.replace('|', "\\|").replace('\n', " ")
}

/// The whole page, dated `date` (YYYY-MM-DD) and stamped with the `commit` it ran on.
pub fn render(results: &[KernelResult], date: &str, commit: &str) -> String {
    let mut page = String::new();
    let releases: Vec<String> = results
        .iter()
        .map(|r| {
            format!(
                "{} = `{}`",
                r.kernel,
                r.release.as_deref().unwrap_or("did not boot")
            )
        })
        .collect();
    let _ = writeln!(page, "# Kernel support\n");
    let _ = writeln!(
        page,
        "Generated by `cargo xtask vm` on {date}. Do not edit: run it again.\n"
    );
    let _ = writeln!(page, "{STAMP}`{commit}`.\n");
    let _ = writeln!(page, "Kernels: {}.\n", releases.join(", "));
    let _ = writeln!(
        page,
        "Each cell sums the end-to-end tests of that capability on that kernel: `pass`, `FAIL` \
         (a test failed), `skip: reason` (every test skipped a check the kernel lacks) or `—` \
         (no test ran).\n"
    );
    if results.iter().any(|r| r.kernel.ends_with(ARM64_SUFFIX)) {
        let _ = writeln!(
            page,
            "The `{ARM64_SUFFIX}` columns are Debian's arm64 builds of the same kernels, emulated \
             (qemu-system-aarch64 under TCG on an amd64 machine, not arm64 hardware), with the \
             tiers verifier and hooks cross-built for aarch64: the kernel's own answers. Their \
             `—` cells are capabilities that only the other tiers (the agent's bookkeeping, user \
             space) show.\n"
        );
    }
    let header: Vec<&str> = results.iter().map(|r| r.kernel.as_str()).collect();
    let _ = writeln!(page, "| capability | {} |", header.join(" | "));
    let _ = writeln!(page, "|---|{}", "---|".repeat(results.len()));
    for capability in CAPABILITIES {
        let cells: Vec<String> = results.iter().map(|r| cell(capability, r)).collect();
        let _ = writeln!(page, "| {} | {} |", capability.name, cells.join(" | "));
    }
    let _ = writeln!(page, "\n## Totals\n");
    for r in results {
        let _ = writeln!(
            page,
            "- **{}** ({}): {}{}",
            r.kernel,
            r.release.as_deref().unwrap_or("release unknown"),
            r.totals(),
            r.error
                .as_deref()
                .map_or(String::new(), |e| format!("; {e}")),
        );
    }
    let _ = writeln!(page, "\n## Skips and failures\n");
    let mut any = false;
    for r in results {
        let listed: Vec<&TestResult> = r
            .tests
            .iter()
            .filter(|t| matches!(t.outcome, Outcome::Fail | Outcome::Skip))
            .collect();
        if listed.is_empty() && r.error.is_none() {
            continue;
        }
        any = true;
        let _ = writeln!(page, "### {}\n", r.kernel);
        if let Some(error) = &r.error {
            let _ = writeln!(page, "- the kernel failed: {error}");
        }
        for t in listed {
            let what = if t.outcome == Outcome::Fail {
                "FAIL"
            } else {
                "skip"
            };
            let reason = t.reason.as_deref().unwrap_or("no reason given");
            let _ = writeln!(
                page,
                "- `{}::{}` {what}: {}",
                t.binary,
                t.name,
                reason.trim()
            );
        }
        let _ = writeln!(page);
    }
    if !any {
        let _ = writeln!(page, "None.\n");
    }
    page.truncate(page.trim_end().len());
    page.push('\n');
    page
}

pub fn write(path: &Path, results: &[KernelResult]) -> Result<()> {
    fs::write(path, render(results, &today(), &head_commit()?))
        .with_context(|| format!("writing {}", path.display()))
}

/// What the names of the arm64 kernels end with (`6.1-arm64`).
pub const ARM64_SUFFIX: &str = "-arm64";

/// How the page names the commit it ran on.
const STAMP: &str = "Commit: ";

/// What a change to these paths can change in the table: the kernel programs, the types they
/// share with user space, and the user space that loads, attaches, adopts and takes over
/// (`capture-user/src/ebpf`: the loader and the takeover among it).
pub const KERNEL_FACING: &[&str] = &[
    "capture-ebpf",
    "capture-common",
    "capture-user/build.rs",
    "capture-user/src/ebpf",
];

/// HEAD, with `-dirty` when the tree has changes of its own to the paths that matter.
fn head_commit() -> Result<String> {
    let hash = crate::output(Command::new("git").args(["rev-parse", "HEAD"]))?;
    let changes = crate::output(
        Command::new("git")
            .args(["status", "--porcelain", "--"])
            .args(KERNEL_FACING),
    )?;
    Ok(if changes.is_empty() {
        hash
    } else {
        format!("{hash}-dirty")
    })
}

/// The commit a kernel support page says it ran on.
pub fn stamped_commit(page: &str) -> Option<&str> {
    page.lines()
        .find_map(|l| l.strip_prefix(STAMP))
        .map(|c| c.trim().trim_end_matches('.').trim_matches('`'))
}

/// What changed in `KERNEL_FACING` between the commit `page` ran on and HEAD: the files, or why
/// that cannot be told.
pub fn changed_since(page: &str) -> Result<Vec<String>, String> {
    let Some(commit) = stamped_commit(page) else {
        return Err("it names no commit".into());
    };
    if commit.ends_with("-dirty") {
        return Err(format!("it ran on {commit}, with changes of its own"));
    }
    let diff = Command::new("git")
        .args(["diff", "--name-only", commit, "HEAD", "--"])
        .args(KERNEL_FACING)
        .output()
        .map_err(|e| format!("git diff: {e}"))?;
    if !diff.status.success() {
        return Err(format!("its commit {commit} is not in this clone"));
    }
    Ok(String::from_utf8_lossy(&diff.stdout)
        .lines()
        .map(str::to_string)
        .collect())
}

/// Today's UTC date as YYYY-MM-DD, from the system clock (days since 1970 to a civil date).
fn today() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let days = i64::try_from(secs / 86_400).unwrap_or(0);
    let (y, m, d) = civil_from_days(days);
    format!("{y:04}-{m:02}-{d:02}")
}

/// The proleptic Gregorian date `days` after 1970-01-01 (eras of 400 years, March-based years).
pub fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1_460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = u32::try_from(doy - (153 * mp + 2) / 5 + 1).unwrap_or(1);
    let m = u32::try_from(if mp < 10 { mp + 3 } else { mp - 9 }).unwrap_or(1);
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}
