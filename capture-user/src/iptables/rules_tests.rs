use super::*;
use crate::config::{
    PodSpec, ANN_EXCLUDE_INBOUND_PORTS, ANN_EXCLUDE_OUTBOUND_CIDRS, ANN_EXCLUDE_OUTBOUND_PORTS,
    ANN_INCLUDE_INBOUND_PORTS, ANN_INCLUDE_OUTBOUND_CIDRS, ANN_INCLUDE_OUTBOUND_PORTS,
};

fn with_mesh(annotations: &[(&str, &str)], mesh: crate::config::MeshDefaults) -> CaptureConfig {
    pod_config(annotations, &[], mesh)
}

fn pod_config(
    annotations: &[(&str, &str)],
    uids: &[u32],
    mesh: crate::config::MeshDefaults,
) -> CaptureConfig {
    CaptureConfig::from_pod(&PodSpec {
        proxy_uids: uids.to_vec(),
        mesh,
        ..PodSpec::of_annotations(&["10.1.0.10", "fd00:1::10"], annotations)
    })
    .unwrap()
}

fn dns(nameservers: &[&str], capture_all: bool) -> crate::config::MeshDefaults {
    crate::config::MeshDefaults {
        redirect_dns: true,
        capture_all_dns: capture_all,
        nameservers: nameservers.iter().map(|n| n.parse().unwrap()).collect(),
        ..crate::config::MeshDefaults::default()
    }
}

fn config(annotations: &[(&str, &str)], uids: &[u32]) -> CaptureConfig {
    pod_config(annotations, uids, crate::config::MeshDefaults::default())
}

#[test]
fn default_sidecar_matches_the_spec_rule_set() {
    let want = include_str!("testdata/rules-default-sidecar.v4.txt");
    assert_eq!(restore_input(&config(&[], &[]), Family::V4), want);
}

#[test]
fn ipv6_uses_its_own_loopback_and_passthrough_addresses() {
    let v6 = nat_rules(&config(&[], &[]), Family::V6);
    let v4 = nat_rules(&config(&[], &[]), Family::V4);
    assert_eq!(v6.len(), v4.len());
    assert!(v6.contains(&"-A ISTIO_OUTPUT -o lo -s ::6/128 -j RETURN".to_string()));
    assert!(v6.contains(&"-A ISTIO_OUTPUT -d ::1/128 -j RETURN".to_string()));
    assert!(!v6.iter().any(|l| l.contains("127.0.0.")), "{v6:#?}");
}

#[test]
fn lists_land_in_istio_order_and_family() {
    let rules = nat_rules(
        &config(
            &[
                (ANN_EXCLUDE_OUTBOUND_PORTS, "5555"),
                (ANN_EXCLUDE_OUTBOUND_CIDRS, "10.2.0.0/16,fd00:2::/64"),
                (ANN_INCLUDE_OUTBOUND_PORTS, "32000"),
                (ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8"),
            ],
            &[],
        ),
        Family::V4,
    );
    let pos = |needle: &str| {
        rules
            .iter()
            .position(|l| l == needle)
            .unwrap_or_else(|| panic!("{needle} missing from {rules:#?}"))
    };
    let o_tcp = pos("-A ISTIO_OUTPUT -p tcp --dport 5555 -j RETURN");
    let o_udp = pos("-A ISTIO_OUTPUT -p udp --dport 5555 -j RETURN");
    let passthrough = pos("-A ISTIO_OUTPUT -o lo -s 127.0.0.6/32 -j RETURN");
    let loopback = pos("-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN");
    let x = pos("-A ISTIO_OUTPUT -d 10.2.0.0/16 -j RETURN");
    let q = pos("-A ISTIO_OUTPUT -p tcp --dport 32000 -j ISTIO_REDIRECT");
    let i = pos("-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT");
    assert!(
        o_tcp < o_udp
            && o_udp < passthrough
            && passthrough < loopback
            && loopback < x
            && x < q
            && q < i
    );
    assert_eq!(
        rules.last().map(String::as_str),
        Some("-A ISTIO_OUTPUT -d 10.0.0.0/8 -j ISTIO_REDIRECT")
    );
    assert!(
        !rules.iter().any(|l| l.contains("fd00")),
        "v6 CIDRs stay out of the v4 set"
    );
    assert!(
        !rules.contains(&"-A ISTIO_OUTPUT -j ISTIO_REDIRECT".to_string()),
        "no catch-all with an include list"
    );
}

#[test]
fn inbound_variants() {
    let none = nat_rules(&config(&[(ANN_INCLUDE_INBOUND_PORTS, "")], &[]), Family::V4);
    assert!(
        !none.iter().any(|l| l.starts_with("-A PREROUTING")),
        "empty include: no inbound capture"
    );
    // T45: an explicit include list ignores excludeInboundPorts.
    let explicit = nat_rules(
        &config(
            &[
                (ANN_INCLUDE_INBOUND_PORTS, "8080"),
                (ANN_EXCLUDE_INBOUND_PORTS, "8080"),
            ],
            &[],
        ),
        Family::V4,
    );
    assert!(
        explicit.contains(&"-A ISTIO_INBOUND -p tcp --dport 8080 -j ISTIO_IN_REDIRECT".to_string())
    );
    assert!(
        !explicit
            .iter()
            .any(|l| l.contains("--dport 8080 -j RETURN")),
        "{explicit:#?}"
    );
    assert!(!explicit.contains(&"-A ISTIO_INBOUND -p tcp -j ISTIO_IN_REDIRECT".to_string()));
}

#[test]
fn several_uids_and_loopback_include() {
    let rules = nat_rules(
        &config(
            &[(ANN_INCLUDE_OUTBOUND_CIDRS, "127.1.2.3/32")],
            &[1337, 1338],
        ),
        Family::V4,
    );
    let owners: Vec<&String> = rules.iter().filter(|l| l.contains("-owner")).collect();
    // Per id: IN_REDIRECT and RETURN; the lo-RETURN is dropped because an include CIDR is loopback (E.9).
    assert_eq!(owners.len(), 2 * 4, "{owners:#?}");
    assert!(
        owners[0].contains("--uid-owner 1337 -j ISTIO_IN_REDIRECT")
            && owners[2].contains("--uid-owner 1338")
    );
    assert!(!rules.iter().any(|l| l.contains("! --uid-owner")));
}

#[test]
fn dns_capture_matches_the_spec_rule_set() {
    let want = include_str!("testdata/rules-default-sidecar-dns.v4.txt");
    assert_eq!(
        restore_input(&with_mesh(&[], dns(&["10.96.0.10"], false)), Family::V4),
        want
    );
}

#[test]
fn dns_capture_all_and_ipv6_nameservers() {
    let cfg = with_mesh(&[], dns(&[], true));
    let nat = nat_rules(&cfg, Family::V4);
    assert!(
        nat.contains(
            &"-A ISTIO_OUTPUT_DNS -p tcp --dport 53 -j REDIRECT --to-ports 15053".to_string()
        ),
        "{nat:#?}"
    );
    assert!(nat.contains(
        &"-A ISTIO_OUTPUT_DNS -p udp --dport 53 -j REDIRECT --to-port 15053".to_string()
    ));
    let raw = raw_rules(&cfg, Family::V4);
    assert!(
        raw.contains(&"-A ISTIO_INBOUND -p udp --sport 53 -j CT --zone 1".to_string()),
        "{raw:#?}"
    );
    let cfg = with_mesh(&[], dns(&["10.96.0.10", "fd00::a"], false));
    let v6 = nat_rules(&cfg, Family::V6);
    assert!(
        v6.contains(
            &"-A ISTIO_OUTPUT_DNS -p udp --dport 53 -d fd00::a/128 -j REDIRECT --to-port 15053"
                .to_string()
        ),
        "{v6:#?}"
    );
    assert!(!v6.iter().any(|l| l.contains("10.96.0.10")));
    // A pod's proxy.istio.io/config can turn the mesh default off.
    let off = with_mesh(
        &[(
            crate::config::ANN_PROXY_CONFIG,
            "proxyMetadata:\n  ISTIO_META_DNS_CAPTURE: \"false\"\n",
        )],
        dns(&[], true),
    );
    assert!(off.dns.is_none());
    assert!(raw_rules(&off, Family::V4).is_empty());
    // And on: DNS on, capture-all off, no nameservers means off (as Istio).
    let none = with_mesh(
        &[(
            crate::config::ANN_PROXY_CONFIG,
            "{\"proxyMetadata\": {\"ISTIO_META_DNS_CAPTURE\": \"true\"}}",
        )],
        crate::config::MeshDefaults::default(),
    );
    assert!(none.dns.is_none());
}

#[test]
fn owner_groups_rules() {
    let mesh = |inc: Option<&str>, exc: Option<&str>| crate::config::MeshDefaults {
        owner_groups: inc.map(String::from),
        owner_groups_exclude: exc.map(String::from),
        ..crate::config::MeshDefaults::default()
    };
    let only = nat_rules(&with_mesh(&[], mesh(Some("202,303"), None)), Family::V4);
    let pos = |rules: &[String], needle: &str| {
        rules
            .iter()
            .position(|l| l == needle)
            .unwrap_or_else(|| panic!("{needle} missing from {rules:#?}"))
    };
    let groups = pos(
        &only,
        "-A ISTIO_OUTPUT -m owner ! --gid-owner 202 -m owner ! --gid-owner 303 -j RETURN",
    );
    assert!(groups > pos(&only, "-A ISTIO_OUTPUT -m owner --gid-owner 1337 -j RETURN"));
    assert!(groups < pos(&only, "-A ISTIO_OUTPUT -d 127.0.0.1/32 -j RETURN"));
    let except = nat_rules(&with_mesh(&[], mesh(None, Some("888,0"))), Family::V4);
    pos(
        &except,
        "-A ISTIO_OUTPUT -m owner --gid-owner 888 -j RETURN",
    );
    pos(&except, "-A ISTIO_OUTPUT -m owner --gid-owner 0 -j RETURN");
    let nothing = nat_rules(&with_mesh(&[], mesh(Some(""), None)), Family::V4);
    pos(&nothing, "-A ISTIO_OUTPUT -j RETURN");
    let root_by_name = with_mesh(&[], mesh(Some("root"), None));
    assert_eq!(root_by_name.owner_groups, OwnerGroups::Only(vec![0]));
}

#[test]
fn interfaces_and_drop_invalid() {
    use crate::config::{ANN_EXCLUDE_INTERFACES, ANN_KUBEVIRT_INTERFACES};
    let kv = nat_rules(
        &config(&[(ANN_KUBEVIRT_INTERFACES, "eth1,eth2")], &[]),
        Family::V4,
    );
    let head: Vec<&str> = kv.iter().skip(4).take(2).map(String::as_str).collect();
    assert_eq!(
        head,
        [
            "-I PREROUTING 1 -i eth1 -j RETURN",
            "-I PREROUTING 1 -i eth2 -j RETURN"
        ]
    );
    let tail: Vec<&str> = kv.iter().rev().take(2).rev().map(String::as_str).collect();
    assert_eq!(
        tail,
        [
            "-I PREROUTING 1 -i eth1 -j ISTIO_REDIRECT",
            "-I PREROUTING 1 -i eth2 -j ISTIO_REDIRECT"
        ]
    );
    let kv_cidr = nat_rules(
        &config(
            &[
                (ANN_KUBEVIRT_INTERFACES, "eth1"),
                (ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8"),
            ],
            &[],
        ),
        Family::V4,
    );
    assert_eq!(
        kv_cidr.last().unwrap(),
        "-I PREROUTING 1 -i eth1 -d 10.0.0.0/8 -j ISTIO_REDIRECT"
    );
    let ex = nat_rules(
        &config(&[(ANN_EXCLUDE_INTERFACES, "not-istio-nic")], &[]),
        Family::V4,
    );
    assert_eq!(
        &ex[4..6],
        [
            "-A PREROUTING -i not-istio-nic -j RETURN",
            "-A OUTPUT -o not-istio-nic -j RETURN"
        ]
    );
    let mesh = crate::config::MeshDefaults {
        drop_invalid: true,
        ..crate::config::MeshDefaults::default()
    };
    let input = restore_input(&with_mesh(&[], mesh), Family::V4);
    assert!(
        input.starts_with(
            "* mangle\n-N ISTIO_DROP\n-A PREROUTING -m conntrack --ctstate INVALID -j ISTIO_DROP\n-A ISTIO_DROP -j DROP\nCOMMIT\n* nat\n"
        ),
        "{input}"
    );
}

#[test]
fn removal_undoes_inserts_and_every_table() {
    use crate::config::ANN_KUBEVIRT_INTERFACES;
    let mut mesh = dns(&[], true);
    mesh.drop_invalid = true;
    let cfg = with_mesh(&[(ANN_KUBEVIRT_INTERFACES, "eth1")], mesh);
    let undo = crate::iptables::apply::removal_input(&cfg, Family::V4);
    for line in [
        "-D PREROUTING -i eth1 -j RETURN",
        "-D PREROUTING -i eth1 -j ISTIO_REDIRECT",
        "-D PREROUTING -m conntrack --ctstate INVALID -j ISTIO_DROP",
        "-X ISTIO_DROP",
        "-D OUTPUT -j ISTIO_OUTPUT_DNS",
        "-X ISTIO_OUTPUT_DNS",
    ] {
        assert!(
            undo.lines().any(|l| l == line),
            "{line} missing from\n{undo}"
        );
    }
    assert!(undo.starts_with("* mangle\n"), "{undo}");
}

#[test]
fn tproxy_matches_the_spec_rule_set() {
    let want = include_str!("testdata/rules-default-sidecar-tproxy.v4.txt");
    let cfg = config(&[(crate::config::ANN_INTERCEPTION_MODE, "TPROXY")], &[]);
    assert_eq!(restore_input(&cfg, Family::V4), want);
}

#[test]
fn tproxy_with_an_include_list_and_ipv6() {
    let cfg = config(
        &[
            (crate::config::ANN_INTERCEPTION_MODE, "TPROXY"),
            (ANN_INCLUDE_INBOUND_PORTS, "32000,31000"),
        ],
        &[],
    );
    let m = mangle_rules(&cfg, Family::V4);
    let want = [
        "-A ISTIO_INBOUND -p tcp --dport 32000 -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT",
        "-A ISTIO_INBOUND -p tcp --dport 32000 -j ISTIO_TPROXY",
        "-A ISTIO_INBOUND -p tcp --dport 31000 -m conntrack --ctstate RELATED,ESTABLISHED -j ISTIO_DIVERT",
        "-A ISTIO_INBOUND -p tcp --dport 31000 -j ISTIO_TPROXY",
    ];
    let at = m.iter().position(|l| l == want[0]).expect("include rules");
    assert_eq!(&m[at..at + 4], want);
    let v6 = mangle_rules(&cfg, Family::V6);
    assert!(
        v6.contains(&"-I ISTIO_INBOUND 2 -p tcp -s ::6/128 -i lo -j RETURN".to_string()),
        "{v6:#?}"
    );
    assert!(v6
        .iter()
        .any(|l| l.starts_with("-A ISTIO_TPROXY ! -d ::1/128")));
    let undo = crate::iptables::apply::removal_input(&cfg, Family::V4);
    assert!(
        undo.contains("-X ISTIO_DIVERT")
            && undo.contains("-D OUTPUT -p tcp -o lo -m mark --mark 1337 -j RETURN"),
        "{undo}"
    );
}

#[test]
fn a_pod_captured_in_place_spares_its_open_connections_and_loses_the_rules_on_removal() {
    let plain = config(&[], &[1337]);
    let spare = format!("-p tcp ! --syn -m comment --comment \"{SPARE_COMMENT}\" -j RETURN");
    assert!(!restore_input(&plain, Family::V4).contains("! --syn"));
    let cfg = CaptureConfig {
        spare_open_connections: true,
        ..plain
    };
    for family in [Family::V4, Family::V6] {
        let nat = nat_rules(&cfg, family);
        let undo = crate::iptables::apply::removal_input(&cfg, family);
        for builtin in ["PREROUTING", "OUTPUT"] {
            // Inserted last, so first in the chain: before every jump to Istio's chains.
            assert!(nat.contains(&format!("-I {builtin} 1 {spare}")), "{nat:#?}");
            assert!(
                undo.lines().any(|l| l == format!("-D {builtin} {spare}")),
                "{undo}"
            );
        }
    }
}
