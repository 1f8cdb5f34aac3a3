use std::collections::BTreeMap;

use nftables::stmt::Statement;

use super::*;
use crate::{
    config::{
        MeshDefaults, PodSpec, ANN_EXCLUDE_INTERFACES, ANN_INCLUDE_INBOUND_PORTS,
        ANN_INCLUDE_OUTBOUND_CIDRS, ANN_INTERCEPTION_MODE, ANN_KUBEVIRT_INTERFACES,
    },
    iptables::rules::{mangle_rules, nat_rules, raw_rules},
};

fn pod(ips: &[&str], annotations: &[(&str, &str)], mesh: MeshDefaults) -> CaptureConfig {
    CaptureConfig::from_pod(&PodSpec {
        proxy_uids: vec![1337, 1338],
        mesh,
        ..PodSpec::of_annotations(ips, annotations)
    })
    .unwrap()
}

fn dns_and_groups() -> MeshDefaults {
    MeshDefaults {
        redirect_dns: true,
        nameservers: vec!["10.96.0.10".parse().unwrap(), "fd00::a".parse().unwrap()],
        owner_groups: Some("1000,2000".into()),
        drop_invalid: true,
        ..MeshDefaults::default()
    }
}

/// The configurations both backends are compared in: every table, chain and variant the
/// iptables rules have.
fn variety() -> Vec<CaptureConfig> {
    let v4 = &["10.1.0.10"];
    let mut spared = pod(v4, &[], MeshDefaults::default());
    spared.spare_open_connections = true;
    vec![
        pod(v4, &[], MeshDefaults::default()),
        spared,
        pod(v4, &[], dns_and_groups()),
        pod(
            v4,
            &[
                (ANN_INTERCEPTION_MODE, "TPROXY"),
                (ANN_INCLUDE_INBOUND_PORTS, "80,8080"),
            ],
            dns_and_groups(),
        ),
        pod(
            v4,
            &[(ANN_INTERCEPTION_MODE, "TPROXY")],
            MeshDefaults::default(),
        ),
        pod(
            v4,
            &[
                (ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8,fd00::/8"),
                (ANN_KUBEVIRT_INTERFACES, "veth-vm,tap0"),
                (ANN_EXCLUDE_INTERFACES, "net1"),
            ],
            MeshDefaults::default(),
        ),
    ]
}

/// iptables rules of one table as chains in their final order (`-I` applied), each rule as its
/// verdict: what the rule does when it matches.
fn iptables_verdicts(lines: &[String]) -> BTreeMap<String, Vec<String>> {
    let mut chains: BTreeMap<String, Vec<String>> = BTreeMap::new();
    for line in lines {
        let words: Vec<&str> = line.split_whitespace().collect();
        let target = words.iter().position(|w| *w == "-j").map(|i| words[i + 1]);
        let verdict = match target {
            Some("RETURN") => "return".to_string(),
            Some("DROP") => "drop".into(),
            Some("ACCEPT") => "accept".into(),
            Some("REDIRECT") => "redirect".into(),
            Some("TPROXY") => "tproxy".into(),
            Some("MARK" | "CONNMARK" | "CT") => "set".into(),
            Some(chain) => format!("jump {}", chain.to_lowercase().replace('_', "-")),
            None => continue,
        };
        let chain = words[1].to_lowercase().replace('_', "-");
        let rules = chains.entry(chain).or_default();
        match words[0] {
            "-A" => rules.push(verdict),
            "-I" => rules.insert(words[2].parse::<usize>().unwrap() - 1, verdict),
            _ => {}
        }
    }
    chains
}

fn nft_verdict(rule: &Rule) -> String {
    let tproxy = rule.stmts.iter().any(|s| matches!(s, Statement::TProxy(_)));
    match rule.stmts.last().unwrap() {
        _ if tproxy => "tproxy".into(),
        Statement::Return(_) => "return".into(),
        Statement::Drop(_) => "drop".into(),
        Statement::Accept(_) => "accept".into(),
        Statement::Redirect(_) => "redirect".into(),
        Statement::Mangle(_) => "set".into(),
        Statement::Jump(j) => format!("jump {}", j.target),
        other => panic!("unexpected last statement {other:?}"),
    }
}

fn nft_verdicts(table: &Table) -> BTreeMap<String, Vec<String>> {
    table
        .chains
        .iter()
        .filter(|c| !c.rules.is_empty())
        .map(|c| {
            let rules = c.rules.iter();
            // The IPv4-only pod's first rule in each base chain: IPv6 passes, as no ip6tables
            // rules exist for it.
            let rules = rules.skip(usize::from(c.hook.is_some()));
            (c.name.to_string(), rules.map(nft_verdict).collect())
        })
        .collect()
}

#[test]
fn every_iptables_rule_has_its_nftables_rule_in_the_same_place() {
    for cfg in variety() {
        let tables = tables(&cfg);
        for (name, lines) in [
            (NAT_TABLE, nat_rules(&cfg, Family::V4)),
            (MANGLE_TABLE, mangle_rules(&cfg, Family::V4)),
            (RAW_TABLE, raw_rules(&cfg, Family::V4)),
        ] {
            let mut want = iptables_verdicts(&lines);
            // nftables' tproxy does not drop what no listener takes; a rule after it does.
            if let Some(tproxy) = want.get_mut("istio-tproxy") {
                tproxy.push("drop".into());
            }
            let got = tables
                .iter()
                .find(|t| t.name == name)
                .map(nft_verdicts)
                .unwrap_or_default();
            assert_eq!(got, want, "table {name} of {cfg:#?}");
        }
    }
}

#[test]
fn tables_and_base_chains_are_istios() {
    let cfg = pod(
        &["10.1.0.10", "fd00::10"],
        &[(ANN_INTERCEPTION_MODE, "TPROXY")],
        dns_and_groups(),
    );
    let tables = tables(&cfg);
    let names: Vec<&str> = tables.iter().map(|t| t.name).collect();
    assert_eq!(names, [MANGLE_TABLE, NAT_TABLE, RAW_TABLE]);
    let hook = |table: &str, chain: &str| {
        let t = tables.iter().find(|t| t.name == table).unwrap();
        let c = t.chains.iter().find(|c| c.name == chain).unwrap();
        c.hook.map(|h| (h.kind, h.hook, h.priority))
    };
    assert_eq!(
        hook(NAT_TABLE, OUTPUT),
        Some((NfChainType::NAT, NfHook::Output, -100))
    );
    assert_eq!(
        hook(MANGLE_TABLE, OUTPUT),
        Some((NfChainType::Route, NfHook::Output, -150))
    );
    assert_eq!(
        hook(RAW_TABLE, PREROUTING),
        Some((NfChainType::Filter, NfHook::Prerouting, -300))
    );
    assert_eq!(hook(NAT_TABLE, "istio-output"), None);
    // Dual-stack: no rule turns IPv6 away.
    let any_nfproto = tables
        .iter()
        .flat_map(|t| &t.chains)
        .flat_map(|c| &c.rules)
        .any(|r| r.stmts.first() == Some(&nfproto(Family::V6)));
    assert!(!any_nfproto);
}

#[test]
fn a_dual_stack_pod_gets_each_address_rule_once_per_family() {
    let cfg = pod(&["10.1.0.10", "fd00::10"], &[], MeshDefaults::default());
    let nat = &tables(&cfg)[0];
    let output = nat
        .chains
        .iter()
        .find(|c| c.name == "istio-output")
        .unwrap();
    let v4 = iptables_verdicts(&nat_rules(&cfg, Family::V4));
    // The passthrough and the loopback returns, and the proxy's loopback redirect per owner,
    // exist once per family; the rest once.
    let per_family = 2 + cfg.proxy_uids.len() + cfg.proxy_gids.len();
    assert_eq!(output.rules.len(), v4["istio-output"].len() + per_family);
}
