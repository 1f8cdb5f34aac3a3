//! Istio's own rule tests, run against capture's rule backends: every configuration of
//! istio/istio's `tools/istio-iptables/pkg/capture/run_test.go` (`TestIptables`),
//! `tools/istio-nftables/pkg/capture/run_test.go` (`TestNftables`) and
//! `cni/pkg/plugin/plugin_dryrun_test.go` (`TestIPTablesRuleGeneration`), expressed as
//! `capture attach` settings. Istio's expected rules (`tests/data/istio/`, taken from those
//! tests' golden files) are applied in one scratch netns with Istio's own tool input
//! (`iptables-restore`, `nft -f`), capture attaches to another, and both are listed by the same
//! tool and compared chain by chain, rule for rule. Where capture writes other rules on purpose,
//! the case names the difference and docs/how-it-works/semantics.md or
//! docs/how-it-works/nftables.md says why.

use std::{
    path::{Path, PathBuf},
    process::Command,
};

use capture_tests::{
    guards::{output_text, run, CaptureDirs, CgroupGuard, NetnsGuard, TempFile},
    istio_goldens::{
        apply, iptables_inputs, listed_iptables, listed_nft, with_groups, DATA, GROUPS,
    },
    topology::capture_bin,
};

const POD_IP4: &str = "10.1.0.10";
const POD_IP6: &str = "fd00:1::10";

/// One of Istio's configurations.
struct Case {
    /// Its name in Istio's table, and of its golden file.
    name: &'static str,
    /// `EnableIPv6`: the pod has an IPv6 address too.
    ipv6: bool,
    /// The same settings as `capture attach` arguments.
    args: &'static [&'static str],
}

const fn case(name: &'static str, ipv6: bool, args: &'static [&'static str]) -> Case {
    Case { name, ipv6, args }
}

const INCLUDE_IN: &str = "--annotation=traffic.sidecar.istio.io/includeInboundPorts=";

/// `TestIptables` and `TestNftables`: the two tables are the same but for nftables'
/// `inbound-ports-empty-tproxy`. Istio's base configuration is istio-iptables' flags with the
/// proxy on 1337 (uid and gid), so `--defaults istio-iptables`.
#[expect(
    clippy::too_many_lines,
    reason = "a table: one entry per case of Istio's run_test.go"
)]
fn tool_cases() -> Vec<Case> {
    vec![
        case(
            "ipv6-empty-inbound-ports",
            true,
            &["--annotation=traffic.sidecar.istio.io/includeInboundPorts="],
        ),
        case(
            "ip-range",
            false,
            &[
                "--annotation=traffic.sidecar.istio.io/excludeOutboundIPRanges=1.1.0.0/16",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=9.9.0.0/16",
                "--redirect-dns",
                "--dns-nameserver=127.0.0.53",
                "--proxy-uid=3,4",
                "--proxy-gid=1,2",
            ],
        ),
        case(
            "tproxy",
            true,
            &[
                "--annotation=sidecar.istio.io/interceptionMode=TPROXY",
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=*",
                "--annotation=traffic.sidecar.istio.io/excludeOutboundIPRanges=1.1.0.0/16",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=9.9.0.0/16",
                "--annotation=traffic.sidecar.istio.io/excludeInterfaces=not-istio-nic",
                "--redirect-dns",
                "--dns-nameserver=127.0.0.53",
            ],
        ),
        case(
            "ipv6-inbound-ports",
            true,
            &["--annotation=traffic.sidecar.istio.io/includeInboundPorts=4000,5000"],
        ),
        case(
            "ipv6-virt-interfaces",
            true,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=4000,5000",
                "--annotation=istio.io/reroute-virtual-interfaces=eth0,eth1",
            ],
        ),
        case(
            "ipv6-ipnets",
            true,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=4000,5000",
                // Istio's flag value is "6000,7000,": istio-iptables skips the empty item, which
                // as an annotation istio-cni refuses (`validatePortList`), and capture with it.
                "--annotation=traffic.sidecar.istio.io/excludeInboundPorts=6000,7000",
                "--annotation=istio.io/reroute-virtual-interfaces=eth0,eth1",
                "--annotation=traffic.sidecar.istio.io/excludeOutboundIPRanges=2001:db8::/32",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=2001:db8::/32",
            ],
        ),
        case(
            "ipv6-uid-gid",
            true,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=4000,5000",
                "--annotation=traffic.sidecar.istio.io/excludeInboundPorts=6000,7000",
                "--annotation=istio.io/reroute-virtual-interfaces=eth0,eth1",
                "--annotation=traffic.sidecar.istio.io/excludeOutboundIPRanges=2001:db8::/32",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=2001:db8::/32",
                "--proxy-uid=3,4",
                "--proxy-gid=1,2",
            ],
        ),
        case(
            "ipv6-outbound-ports",
            true,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=",
                "--annotation=traffic.sidecar.istio.io/includeOutboundPorts=32000,31000",
            ],
        ),
        case("empty", false, &[]),
        case(
            "kube-virt-interfaces",
            false,
            &[
                "--annotation=istio.io/reroute-virtual-interfaces=eth1,eth2",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=*",
            ],
        ),
        case(
            "ipnets",
            false,
            &["--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/8"],
        ),
        case(
            "ipnets-with-kube-virt-interfaces",
            false,
            &[
                "--annotation=istio.io/reroute-virtual-interfaces=eth1,eth2",
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/8",
            ],
        ),
        case(
            "inbound-ports-include",
            false,
            &["--annotation=traffic.sidecar.istio.io/includeInboundPorts=32000,31000"],
        ),
        case(
            "inbound-ports-wildcard",
            false,
            &["--annotation=traffic.sidecar.istio.io/includeInboundPorts=*"],
        ),
        case(
            "inbound-ports-tproxy",
            false,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=32000,31000",
                "--annotation=sidecar.istio.io/interceptionMode=TPROXY",
            ],
        ),
        case(
            "inbound-ports-wildcard-tproxy",
            false,
            &[
                "--annotation=traffic.sidecar.istio.io/includeInboundPorts=*",
                "--annotation=sidecar.istio.io/interceptionMode=TPROXY",
            ],
        ),
        case(
            "dns-uid-gid",
            true,
            &[
                "--redirect-dns",
                "--dns-nameserver=127.0.0.53",
                "--dns-nameserver=::127.0.0.53",
                "--proxy-uid=3,4",
                "--proxy-gid=1,2",
            ],
        ),
        case(
            "ipv6-dns-uid-gid",
            true,
            &["--redirect-dns", "--proxy-uid=3,4", "--proxy-gid=1,2"],
        ),
        case("outbound-owner-groups", false, &["--owner-groups=java,202"]),
        case(
            "outbound-owner-groups-exclude",
            false,
            &["--owner-groups-exclude=888,ftp"],
        ),
        case(
            "ipv6-dns-outbound-owner-groups",
            true,
            &["--redirect-dns", "--owner-groups=java,202"],
        ),
        case(
            "ipv6-dns-outbound-owner-groups-exclude",
            true,
            &["--redirect-dns", "--owner-groups-exclude=888,ftp"],
        ),
        case(
            "outbound-ports-include",
            false,
            &["--annotation=traffic.sidecar.istio.io/includeOutboundPorts=32000,31000"],
        ),
        case(
            "loopback-outbound-iprange",
            false,
            &[
                "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=127.1.2.3/32",
                "--redirect-dns",
                "--dns-nameserver=127.0.0.53",
                "--proxy-uid=3,4",
                "--proxy-gid=1,2",
            ],
        ),
        case(
            "basic-exclude-nic",
            false,
            &["--annotation=traffic.sidecar.istio.io/excludeInterfaces=not-istio-nic"],
        ),
        case("drop-invalid", false, &["--drop-invalid"]),
        case(
            "host-ipv4-loopback-cidr",
            false,
            &["--ipv4-loopback-cidr=127.0.0.1/8"],
        ),
    ]
}

/// `TestIPTablesRuleGeneration`: a pod with Istio's status annotation through istio-cni, so
/// `--defaults cni`; the proxy container's env and security context as capture's settings.
fn cni_cases() -> Vec<(Case, &'static str)> {
    vec![
        (case("basic", false, &[]), "basic"),
        (
            case(
                "include-exclude-ip",
                false,
                &[
                    "--annotation=traffic.sidecar.istio.io/includeOutboundIPRanges=127.0.0.0/8",
                    "--annotation=traffic.sidecar.istio.io/excludeOutboundIPRanges=10.0.0.0/8",
                ],
            ),
            "include-exclude-ip",
        ),
        (
            case(
                "include-exclude-ports",
                false,
                &[
                    "--annotation=traffic.sidecar.istio.io/includeInboundPorts=1111,2222",
                    "--annotation=traffic.sidecar.istio.io/excludeInboundPorts=3333,4444",
                    "--annotation=traffic.sidecar.istio.io/excludeOutboundPorts=5555,6666",
                ],
            ),
            "include-exclude-ports",
        ),
        (
            case(
                "tproxy",
                false,
                &["--annotation=sidecar.istio.io/interceptionMode=TPROXY"],
            ),
            "tproxy",
        ),
        (
            case("DNS", false, &["--redirect-dns", "--capture-all-dns"]),
            "dns",
        ),
        (
            case("invalid-drop", false, &["--drop-invalid"]),
            "invalid-drop",
        ),
        (
            case(
                "custom-uid",
                false,
                &["--proxy-uid=1000670000", "--proxy-gid=1000670001"],
            ),
            "custom-uid",
        ),
        // runAsUser 0 is the default proxy uid, to istio-cni.
        (case("custom-uid-zero", false, &[]), "basic"),
        (
            case(
                "custom-uid-tproxy",
                false,
                &[
                    "--annotation=sidecar.istio.io/interceptionMode=TPROXY",
                    "--proxy-uid=1000670000",
                    "--proxy-gid=1000670001",
                ],
            ),
            "custom-uid-tproxy",
        ),
    ]
}

/// What one backend wrote for one case, and what Istio's input gives, both as listed.
struct Listing {
    capture: String,
    istio: String,
}

/// Applies Istio's input for one case in a scratch netns and capture's settings in another.
fn list_both(
    case: &Case,
    mode: &str,
    defaults: &str,
    istio_inputs: &[(&str, PathBuf)],
    groups: &Path,
) -> Listing {
    let list = |netns: &Path| -> String {
        match mode {
            "nftables" => listed_nft(netns, groups),
            _ => listed_iptables(netns, groups),
        }
    };
    let istio_ns = NetnsGuard::new("istio-golden");
    apply(&istio_ns.path(), istio_inputs, groups);

    let pod_ns = NetnsGuard::new("capture-golden");
    run(Command::new("ip").args(["-n", &pod_ns.name, "link", "set", "lo", "up"]));
    let cgroup = CgroupGuard::new("capture-golden");
    let dirs = CaptureDirs::new();
    let mut attach = with_groups(Command::new(capture_bin()), groups);
    // The variant the listings read (the unsuffixed tools), not the one detected from the host's
    // netns, where a test beside this one may hold rules of either: the variant's choice has
    // tests of its own (hooks/iptables_variant.rs).
    attach
        .env("CAPTURE_IPTABLES", "plain")
        .arg("--bpffs")
        .arg(&dirs.bpffs)
        .arg("--state-dir")
        .arg(&dirs.state)
        .arg("attach")
        .arg("--netns")
        .arg(pod_ns.path())
        .arg("--cgroup")
        .arg(&cgroup.path)
        .args(["--mode", mode, "--defaults", defaults, "--pod-ip", POD_IP4]);
    if case.ipv6 {
        attach.args(["--pod-ip", POD_IP6]);
    }
    attach.args(case.args);
    let out = attach.output().expect("capture attach");
    assert!(
        out.status.success(),
        "{}: capture attach --mode {mode} {:?} failed: {}",
        case.name,
        case.args,
        output_text(&out)
    );
    let listing = Listing {
        capture: list(&pod_ns.path()),
        istio: list(&istio_ns.path()),
    };
    let out = Command::new(capture_bin())
        .arg("--bpffs")
        .arg(&dirs.bpffs)
        .arg("--state-dir")
        .arg(&dirs.state)
        .arg("detach")
        .arg("--netns")
        .arg(pod_ns.path())
        .output()
        .expect("capture detach");
    assert!(out.status.success(), "detach: {}", output_text(&out));
    listing
}

/// Runs every case and reports every one whose listings differ, with both listings.
fn compare_all(
    mode: &str,
    defaults: &str,
    cases: &[(Case, Vec<(&'static str, PathBuf)>)],
) -> Vec<String> {
    let groups = TempFile::new("istio-golden-groups", GROUPS);
    let mut differing = Vec::new();
    for (case, inputs) in cases {
        let mut listing = list_both(case, mode, defaults, inputs, &groups.path);
        if mode == "nftables" {
            listing.istio = with_nftables_additions(&listing.istio, case.ipv6);
        }
        if listing.capture != listing.istio {
            differing.push(format!(
                "== {} ({mode})\n-- Istio:\n{}-- capture:\n{}",
                case.name, listing.istio, listing.capture
            ));
        }
    }
    differing
}

/// What capture's nftables backend writes beyond Istio's, on purpose
/// (docs/how-it-works/nftables.md): each base chain of a pod without IPv6 first lets IPv6 pass (as
/// the iptables path, which writes no ip6tables rules for it), and `istio-tproxy` drops what its
/// `tproxy` rules found no listener for (as iptables' TPROXY target does; nftables' `tproxy` would
/// let it through to the app).
fn with_nftables_additions(istio: &str, ipv6: bool) -> String {
    let mut out = String::new();
    let mut chain = "";
    for line in istio.lines() {
        out.push_str(line);
        out.push('\n');
        if let Some(name) = line.strip_prefix("  chain ") {
            chain = name;
        }
        if !ipv6 && line.starts_with("    type ") {
            out.push_str("    meta nfproto ipv6 counter return\n");
        }
        if chain == "istio-tproxy" && line.contains(" tproxy ") {
            let (matches, _) = line.split_once(" tproxy ").expect("a tproxy rule");
            out.push_str(&format!("{matches} counter drop\n"));
        }
    }
    // The drops come after every tproxy rule of the chain.
    let (mut kept, mut drops) = (Vec::new(), Vec::new());
    let mut in_tproxy = false;
    for line in out.lines() {
        if line.starts_with("  chain ") {
            kept.append(&mut drops);
            in_tproxy = line == "  chain istio-tproxy";
        }
        if in_tproxy && line.ends_with(" counter drop") {
            drops.push(line.to_string());
        } else {
            kept.push(line.to_string());
        }
    }
    kept.append(&mut drops);
    kept.iter().map(|l| format!("{l}\n")).collect()
}

#[test]
fn istio_iptables_goldens() {
    let cases: Vec<_> = tool_cases()
        .into_iter()
        .map(|c| {
            let inputs = iptables_inputs("iptables", c.name);
            (c, inputs)
        })
        .collect();
    let differing = compare_all("iptables", "istio-iptables", &cases);
    assert!(differing.is_empty(), "{}", differing.join("\n"));
}

#[test]
fn istio_nftables_goldens() {
    let mut cases = tool_cases();
    cases.push(case(
        "inbound-ports-empty-tproxy",
        false,
        &[
            INCLUDE_IN,
            "--annotation=sidecar.istio.io/interceptionMode=TPROXY",
        ],
    ));
    let cases: Vec<_> = cases
        .into_iter()
        .map(|c| {
            let input = Path::new(DATA).join(format!("nftables/{}.nft", c.name));
            (c, vec![("nft", input)])
        })
        .collect();
    let differing = compare_all("nftables", "istio-iptables", &cases);
    assert!(differing.is_empty(), "{}", differing.join("\n"));
}

#[test]
fn istio_cni_goldens() {
    let cases: Vec<_> = cni_cases()
        .into_iter()
        .map(|(c, golden)| {
            let inputs = iptables_inputs("cni", golden);
            (c, inputs)
        })
        .collect();
    let differing = compare_all("iptables", "cni", &cases);
    assert!(differing.is_empty(), "{}", differing.join("\n"));
}
