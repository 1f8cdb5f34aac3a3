//! The console parser and the report, on a synthetic console log.

use std::path::PathBuf;

use super::{
    console::Console,
    features::kernel_has,
    lines::clean,
    model::{KernelResult, Outcome, TestBinary},
    report::{cell, civil_from_days, render, stamped_commit, CAPABILITIES},
    results,
};

fn binary(name: &str, tests: &[&str]) -> TestBinary {
    TestBinary {
        name: name.to_string(),
        tier: "hooks".to_string(),
        path: PathBuf::from(format!("/x/{name}")),
        tests: tests.iter().map(ToString::to_string).collect(),
    }
}

/// The parser on a log of `expected`, all run in one VM.
fn parse(kernel: &str, text: &str, expected: &[TestBinary]) -> KernelResult {
    results::parse(kernel, text, &expected.iter().collect::<Vec<_>>())
}

fn expected() -> Vec<TestBinary> {
    vec![
        binary(
            "outbound",
            &[
                "default_sidecar",
                "include_outbound_cidrs",
                "ipv4_only_pod_leaves_ipv6_alone",
                "udp_is_never_sent_to_the_proxy",
            ],
        ),
        binary(
            "parity",
            &[
                "default_sidecar_inbound",
                "iptables_mode_writes_and_removes_exactly_its_rules",
            ],
        ),
        binary("validate", &["fails_for_a_non_proxy_uid"]),
    ]
}

/// A 5.10 guest: outbound finishes (one failure, one result cut by a printk, one skip of a
/// feature 5.10 lacks); parity crashes the kernel half-way (no `end` line); validate never runs.
const LOG_510: &str = "\
[    0.000000] Linux version 5.10.0-32-amd64\r
Booting from ROM...\x1bc\x1b[?7l\x1b[2Jcapture-vm: kernel 5.10.0-32-amd64\r
capture-vm: begin outbound\r
\r
running 4 tests\r
test outbound::include_outbound_cidrs ... \x1b[32mok\x1b[0m\r
[    6.123456] IPv6: ADDRCONF(NETDEV_CHANGE): veth0: link becomes ready\r
test outbound::default_sidecar ... \x1b[31mFAILED\x1b[0m\r
test outbound::ipv4_only_pod_leaves_ipv6_alone ... [    7.000001] device veth1 entered promiscuous mode\r
\x1b[32mok\x1b[0m\r
test outbound::udp_is_never_sent_to_the_proxy ... \x1b[32mok\x1b[m\x0f\r
\r
failures:\r
\r
---- outbound::default_sidecar stdout ----\r
thread 'outbound::default_sidecar' panicked at tests/tests/hooks/outbound.rs:40:5:\r
[    8.500000] veth0: left promiscuous mode\r
expected 15001, got 80\r
note: run with `RUST_BACKTRACE=1` environment variable to display a backtrace\r
\r
\r
failures:\r
    outbound::default_sidecar\r
\r
test result: \x1b[31mFAILED\x1b[0m. 3 passed; 1 failed; 0 ignored; 0 measured; 0 filtered out\r
\r
capture-vm: end outbound rc=101[   30.000002] br0: port 1(veth2) entered disabled state\r
capture-vm: begin parity\r
running 2 tests\r
test parity::default_sidecar_inbound ... \x1b[32mok\x1b[0m\r
[   42.000000] Kernel panic - not syncing: Fatal exception in interrupt\r
capture-xtask: timed out after 1500 s: killed qemu\r
";

/// The skip lines of the log above would come after `done`; they are appended separately to
/// check both verdicts.
fn log_with_skips(skips: &str) -> String {
    format!("{LOG_510}{skips}")
}

fn outcome(result: &KernelResult, binary: &str, name: &str) -> (Outcome, String) {
    let t = result
        .tests
        .iter()
        .find(|t| t.binary == binary && t.name == name)
        .unwrap_or_else(|| panic!("no result for {binary}::{name}"));
    (t.outcome, t.reason.clone().unwrap_or_default())
}

#[test]
fn ansi_codes_and_carriage_returns_are_stripped() {
    assert_eq!(clean("test a ... \x1b[32mok\x1b[0m\r"), "test a ... ok");
    assert_eq!(clean("\x1b[1;31mFAILED\x1b[m\x0f"), "FAILED");
    assert_eq!(clean("a\tb\x1bc\x1b[?7l\x1b[2Jc"), "a\tbc");
}

#[test]
fn the_console_becomes_per_test_results() {
    let log = log_with_skips(
        "capture-skip: outbound::udp_is_never_sent_to_the_proxy\tsock_ops_netns_cookie\tno helper\n",
    );
    let r = parse("5.10", &log, &expected());
    assert!(r.booted);
    assert_eq!(r.release.as_deref(), Some("5.10.0-32-amd64"));
    assert_eq!(r.error.as_deref(), Some("stage 2 did not finish"));
    assert!(r.notes.iter().any(|n| n.contains("Kernel panic")));
    assert!(r.notes.iter().any(|n| n.starts_with("timed out")));

    assert_eq!(
        outcome(&r, "outbound", "include_outbound_cidrs").0,
        Outcome::Pass
    );
    let (o, reason) = outcome(&r, "outbound", "default_sidecar");
    assert_eq!(
        (o, reason.as_str()),
        (Outcome::Fail, "expected 15001, got 80")
    );
    // The printk cut the line; the outcome came on the next one.
    assert_eq!(
        outcome(&r, "outbound", "ipv4_only_pod_leaves_ipv6_alone").0,
        Outcome::Pass
    );
    // 5.10 lacks the helper: an honest skip.
    let (o, reason) = outcome(&r, "outbound", "udp_is_never_sent_to_the_proxy");
    assert_eq!(o, Outcome::Skip);
    assert!(reason.contains("sock_ops_netns_cookie") && reason.contains("no helper"));

    // parity never printed its end line: what it reported stands, the rest did not finish.
    assert_eq!(
        outcome(&r, "parity", "default_sidecar_inbound").0,
        Outcome::Pass
    );
    let (o, reason) = outcome(
        &r,
        "parity",
        "iptables_mode_writes_and_removes_exactly_its_rules",
    );
    assert_eq!((o, reason.as_str()), (Outcome::Fail, "did not finish"));
    let (o, reason) = outcome(&r, "validate", "fails_for_a_non_proxy_uid");
    assert_eq!((o, reason.as_str()), (Outcome::Fail, "did not run"));

    assert_eq!(r.binaries.len(), 2);
    assert_eq!(r.binaries[0].rc, Some(101));
    assert_eq!(r.binaries[1].rc, None);
    assert_eq!(r.count(Outcome::Pass), 3);
    assert_eq!(r.count(Outcome::Fail), 3);
    assert!(r.failed());
}

#[test]
fn a_skip_of_a_feature_the_kernel_has_fails() {
    let log = LOG_510.replace("5.10.0-32-amd64", "6.1.0-50-amd64")
        + "capture-skip: udp_is_never_sent_to_the_proxy\tsock_ops_netns_cookie\tno helper\n"
        + "capture-skip: include_outbound_cidrs\tquantum_sockets\tnot yet\n";
    let r = parse("6.1", &log, &expected());
    let (o, reason) = outcome(&r, "outbound", "udp_is_never_sent_to_the_proxy");
    assert_eq!(o, Outcome::Fail);
    assert!(reason.contains("which this kernel has"), "{reason}");
    let (o, reason) = outcome(&r, "outbound", "include_outbound_cidrs");
    assert_eq!(o, Outcome::Fail);
    assert!(
        reason.contains("unknown feature quantum_sockets"),
        "{reason}"
    );
}

#[test]
fn a_node_feature_may_be_missing_on_the_host_only() {
    let skip = "capture-skip: include_outbound_cidrs\tunified_cgroup_controllers\thybrid\n";
    let guest = parse("6.1", &(LOG_510.to_string() + skip), &expected());
    let (o, reason) = outcome(&guest, "outbound", "include_outbound_cidrs");
    assert_eq!(
        o,
        Outcome::Fail,
        "the guests mount cgroup v2 alone: {reason}"
    );
    let host = parse("host", &(LOG_510.to_string() + skip), &expected());
    let (o, reason) = outcome(&host, "outbound", "include_outbound_cidrs");
    assert_eq!(o, Outcome::Skip, "{reason}");
}

#[test]
fn a_harness_gap_may_be_skipped_on_its_guest_only() {
    let skip = "capture-skip: include_outbound_cidrs\trunc_cloned_binary\tENOENT\n";
    let on_510 = parse("5.10", &(LOG_510.to_string() + skip), &expected());
    assert_eq!(
        outcome(&on_510, "outbound", "include_outbound_cidrs").0,
        Outcome::Skip
    );
    let on_61 = parse("6.1", &(LOG_510.to_string() + skip), &expected());
    assert_eq!(
        outcome(&on_61, "outbound", "include_outbound_cidrs").0,
        Outcome::Fail
    );
}

#[test]
fn feature_versions() {
    assert_eq!(
        kernel_has("so_netns_cookie", Some("5.10.0-32-amd64")),
        Some(false)
    );
    assert_eq!(kernel_has("so_netns_cookie", Some("5.14.0")), Some(true));
    assert_eq!(
        kernel_has("sock_ops_netns_cookie", Some("5.14.21")),
        Some(false)
    );
    assert_eq!(
        kernel_has("sock_ops_netns_cookie", Some("6.12.117+deb13-amd64")),
        Some(true)
    );
    assert_eq!(kernel_has("nonsense", Some("6.12.117")), None);
}

#[test]
fn a_clean_run_passes() {
    let log = "capture-vm: kernel 6.12.117+deb13-amd64\n\
               capture-vm: begin validate\n\
               test fails_for_a_non_proxy_uid ... ok\n\
               capture-vm: end validate rc=0\n\
               capture-vm: done\n";
    let r = parse("6.12", log, &expected()[2..]);
    assert_eq!(r.error, None);
    assert_eq!(r.count(Outcome::Pass), 1);
    assert!(!r.failed());
}

#[test]
fn the_report_sums_capabilities_per_kernel() {
    let log = log_with_skips(
        "capture-skip: outbound::udp_is_never_sent_to_the_proxy\tsock_ops_netns_cookie\tno helper\n",
    );
    let r510 = parse("5.10", &log, &expected());
    let row = |name: &str| {
        CAPABILITIES
            .iter()
            .find(|c| c.name.starts_with(name))
            .unwrap()
    };
    assert_eq!(cell(row("outbound capture"), &r510), "FAIL");
    assert_eq!(cell(row("CIDR annotations"), &r510), "pass");
    assert_eq!(cell(row("IPv4-only"), &r510), "pass");
    assert_eq!(cell(row("inbound capture"), &r510), "pass");
    assert_eq!(cell(row("iptables backend"), &r510), "FAIL");
    assert_eq!(cell(row("TPROXY"), &r510), "—");
    assert_eq!(cell(row("validate"), &r510), "FAIL");

    let mut only_skip = parse("5.10", &log, &expected());
    only_skip
        .tests
        .retain(|t| t.name == "udp_is_never_sent_to_the_proxy");
    assert_eq!(
        cell(row("outbound capture"), &only_skip),
        "skip: sock_ops_netns_cookie: no helper"
    );

    let page = render(&[r510], "2026-05-20", "0123abcd");
    assert!(page.contains("Generated by `cargo xtask vm` on 2026-05-20"));
    assert_eq!(stamped_commit(&page), Some("0123abcd"));
    assert!(page.contains("5.10 = `5.10.0-32-amd64`"));
    assert!(page.contains("| capability | 5.10 |"));
    assert!(page.contains("| TPROXY inbound | — |"));
    assert!(page.contains("3 passed, 3 failed, 1 skipped"));
    assert!(page.contains("`outbound::default_sidecar` FAIL: expected 15001, got 80"));
    assert!(page.contains("`outbound::udp_is_never_sent_to_the_proxy` skip: sock_ops_netns_cookie"));
    assert!(page.contains("the kernel failed: stage 2 did not finish"));
}

#[test]
fn lifecycle_row_leaves_out_tests_counted_elsewhere() {
    let log = "capture-vm: kernel 6.1.0\ncapture-vm: begin lifecycle\n\
               test a_process_that_joins_the_cgroup_after_attach_is_captured ... FAILED\n\
               test attach_is_idempotent_and_refuses_a_conflicting_second_attach ... ok\n\
               capture-vm: end lifecycle rc=101\ncapture-vm: done\n";
    let bins = [binary(
        "lifecycle",
        &[
            "a_process_that_joins_the_cgroup_after_attach_is_captured",
            "attach_is_idempotent_and_refuses_a_conflicting_second_attach",
        ],
    )];
    let r = parse("6.1", log, &bins);
    let row = |name: &str| {
        CAPABILITIES
            .iter()
            .find(|c| c.name.starts_with(name))
            .unwrap()
    };
    assert_eq!(cell(row("lifecycle"), &r), "pass");
    assert_eq!(cell(row("outbound capture"), &r), "FAIL");
}

#[test]
fn dates() {
    assert_eq!(civil_from_days(0), (1970, 1, 1));
    assert_eq!(civil_from_days(19_723), (2024, 1, 1));
    assert_eq!(civil_from_days(20_593), (2026, 5, 20));
}

#[test]
fn a_skip_belongs_to_the_binary_that_just_ended() {
    let log = "capture-vm: kernel 5.10.0-32-amd64\n\
               capture-vm: begin lifecycle\n\
               test shared ... ok\n\
               capture-vm: end lifecycle rc=0\n\
               capture-vm: begin parity\n\
               test shared ... ok\n\
               capture-vm: end parity rc=0\n\
               capture-skip: shared\tsock_ops_netns_cookie\tno helper\n\
               capture-vm: done\n";
    let bins = [
        binary("lifecycle", &["shared"]),
        binary("parity", &["shared"]),
    ];
    let r = parse("5.10", log, &bins);
    assert_eq!(outcome(&r, "lifecycle", "shared").0, Outcome::Pass);
    assert_eq!(outcome(&r, "parity", "shared").0, Outcome::Skip);
    assert!(!r.failed());
}

#[test]
fn a_kernel_split_over_two_vms_reads_as_one_run_in_the_binaries_order() {
    let all = expected();
    let finished = "capture-vm: kernel 6.1.0-50-amd64\n\
        capture-vm: begin validate\ntest fails_for_a_non_proxy_uid ... ok\n\
        capture-vm: end validate rc=0\ncapture-vm: done\n";
    let (first, second) = (vec![&all[2]], vec![&all[0], &all[1]]);
    let mut later = results::parse("6.1", finished, &first);
    later.seconds = 30.0;
    later.log = "6.1.1.log".to_string();
    // The other VM timed out in parity.
    let mut earlier = results::parse("6.1", LOG_510, &second);
    earlier.seconds = 100.0;
    earlier.error = Some("timed out after 1500 s".to_string());
    earlier.log = "6.1.0.log".to_string();
    let merged = KernelResult::merge(vec![later, earlier], &all);
    let order: Vec<&str> = merged.binaries.iter().map(|b| b.name.as_str()).collect();
    assert_eq!(order, ["outbound", "parity", "validate"]);
    assert_eq!(merged.tests.len(), 7);
    assert_eq!(merged.tests[0].binary, "outbound");
    assert_eq!(merged.tests[6].binary, "validate");
    assert_eq!(merged.count(Outcome::Pass), 5);
    assert!((merged.seconds - 130.0).abs() < 1e-9, "{}", merged.seconds);
    assert_eq!(merged.log, "6.1.1.log, 6.1.0.log");
    assert_eq!(merged.error.as_deref(), Some("timed out after 1500 s"));
    assert!(merged.failed());
}

#[test]
fn a_failures_panic_message_reaches_the_terminal() {
    let log = std::env::temp_dir().join(format!("capture-console-{}.log", std::process::id()));
    let mut console = Console::create(&log, "5.10").expect("the log");
    for line in LOG_510.lines() {
        console.line(line).expect("a line");
    }
    let said = console.said().to_vec();
    let _ = std::fs::remove_file(&log);
    let at = said
        .iter()
        .position(|l| {
            l.contains(
                "thread 'outbound::default_sidecar' panicked at tests/tests/hooks/outbound.rs",
            )
        })
        .unwrap_or_else(|| panic!("no panic line in {said:#?}"));
    assert_eq!(said[at + 1].trim(), "expected 15001, got 80", "{said:#?}");
    assert!(
        !said
            .iter()
            .any(|l| l.contains("RUST_BACKTRACE") || l.contains("promiscuous")),
        "the note and printk lines stay in the log: {said:#?}"
    );
    assert!(
        said.iter()
            .any(|l| l == "  FAILED outbound::default_sidecar"),
        "{said:#?}"
    );
}

#[test]
fn the_notice_ci_ends_with_names_the_table_and_reads_as_one_line() {
    let notice = super::kernel_support_notice();
    assert!(
        notice.contains("docs/results/kernel-support.md"),
        "{notice}"
    );
    assert!(
        !notice.contains("  ") && !notice.contains('\n'),
        "{notice:?}"
    );
}

#[test]
fn a_subject_runs_exactly_its_tests_with_the_filters_flags() {
    let subject = binary(
        "outbound",
        &["default_sidecar", "udp_is_never_sent_to_the_proxy"],
    );
    let filter = ["--include-ignored".to_string(), "udp".to_string()];
    assert_eq!(
        subject.run_args(&filter),
        [
            "--test-threads=2",
            "--exact",
            "--include-ignored",
            "outbound::default_sidecar",
            "outbound::udp_is_never_sent_to_the_proxy"
        ]
    );
    let chaos = TestBinary {
        name: "chaos".to_string(),
        tier: "chaos".to_string(),
        path: PathBuf::from("/x/chaos"),
        tests: vec!["add_del_cycles_leak_nothing".to_string()],
    };
    assert_eq!(
        chaos.run_args(&[]),
        ["--test-threads=2", "--exact", "add_del_cycles_leak_nothing"]
    );
    assert_eq!(
        TestBinary::short("cni", "cni::istio::gateway"),
        "istio::gateway"
    );
    assert_eq!(
        TestBinary::short("chaos", "add_del_cycles"),
        "add_del_cycles"
    );
}
