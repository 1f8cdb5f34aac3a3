//! Splitting a kernel's test binaries over several VMs.
//!
//! Each VM emulates on one host thread, so a kernel run in one VM leaves the other cores idle once
//! the faster kernels are done: 5.10 under emulation takes about half as long again as 6.1, and in
//! one VM it alone decided the matrix's wall time. Split in shards of about equal expected time,
//! every kernel's VMs share the cores until the end.

use super::model::TestBinary;

/// Seconds each subject took under 5.10 (the whole matrix of 2026-12-03 on the reference machine,
/// two VMs at a time; explain and trace from their first runs; the subjects issue 33 added or
/// grew from the matrix of 2026-12-04, halved as the unchanged subjects ran about twice as long
/// that day). Only the balance between shards
/// depends on them: a stale or missing figure costs wall time, never a test.
const EXPECTED_SECONDS: &[(&str, u32)] = &[
    ("accel", 57),
    ("agent_socket", 18),
    ("alerts", 3),
    ("bad_input", 8),
    ("cgroup_v1", 28),
    ("chaos", 139),
    ("cni", 170),
    ("cni_defaults", 16),
    ("cni_fight", 25),
    ("coexistence", 17),
    ("containerd", 241),
    ("daemonset", 3),
    ("deploy", 12),
    ("dns_and_groups", 37),
    ("explain", 150),
    ("haproxy", 23),
    ("identity_policy", 15),
    ("image", 6),
    ("interfaces", 45),
    ("istio_goldens", 60),
    ("istio_rules", 28),
    ("iptables_variant", 21),
    ("kernel_compat", 14),
    ("lifecycle", 49),
    ("limits", 52),
    ("live_node", 60),
    ("multi_network", 18),
    ("nftables", 20),
    ("outbound", 99),
    ("owner_identity", 7),
    ("parity", 57),
    ("prometheus", 18),
    ("proxy_identity", 20),
    ("reconcile", 90),
    ("sizing", 40),
    ("sockets", 20),
    ("sockopt_answers", 3),
    ("stateless_redirect", 5),
    ("tproxy", 50),
    ("trace", 100),
    ("upgrade", 202),
    ("userns", 10),
    ("validate", 12),
];

/// What a binary without a figure is expected to take per test.
const SECONDS_PER_UNKNOWN_TEST: u32 = 15;

fn expected_seconds(binary: &TestBinary) -> u32 {
    EXPECTED_SECONDS
        .iter()
        .find(|(name, _)| *name == binary.name)
        .map_or_else(
            || SECONDS_PER_UNKNOWN_TEST * binary.tests.len() as u32,
            |(_, seconds)| *seconds,
        )
}

/// `binaries` in at most `shards` non-empty groups of about equal expected time (the longest
/// binary first, each to the group with the least so far), each group in the order given.
pub fn split(binaries: &[TestBinary], shards: usize) -> Vec<Vec<&TestBinary>> {
    let shards = shards.clamp(1, binaries.len().max(1));
    let mut by_cost: Vec<usize> = (0..binaries.len()).collect();
    by_cost.sort_by_key(|&i| std::cmp::Reverse(expected_seconds(&binaries[i])));
    let mut load = vec![0u32; shards];
    let mut members: Vec<Vec<usize>> = vec![Vec::new(); shards];
    for i in by_cost {
        let lightest = (0..shards)
            .min_by_key(|&s| load[s])
            .expect("at least one shard");
        load[lightest] += expected_seconds(&binaries[i]);
        members[lightest].push(i);
    }
    members
        .into_iter()
        .filter(|m| !m.is_empty())
        .map(|mut m| {
            m.sort_unstable();
            m.into_iter().map(|i| &binaries[i]).collect()
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;

    use super::*;

    fn binary(name: &str, tests: usize) -> TestBinary {
        TestBinary {
            name: name.to_string(),
            tier: "hooks".to_string(),
            path: PathBuf::from(name),
            tests: (0..tests).map(|t| format!("t{t}")).collect(),
        }
    }

    fn names(shard: &[&TestBinary]) -> Vec<String> {
        shard.iter().map(|b| b.name.clone()).collect()
    }

    #[test]
    fn every_binary_runs_once_in_about_equal_shards() {
        let all: Vec<TestBinary> = EXPECTED_SECONDS
            .iter()
            .map(|(name, _)| binary(name, 3))
            .collect();
        let shards = split(&all, 2);
        assert_eq!(shards.len(), 2);
        let mut seen: Vec<String> = shards.iter().flat_map(|s| names(s)).collect();
        seen.sort();
        let mut expected: Vec<String> = all.iter().map(|b| b.name.clone()).collect();
        expected.sort();
        assert_eq!(seen, expected);
        let cost = |s: &[&TestBinary]| s.iter().map(|b| expected_seconds(b)).sum::<u32>();
        let (a, b) = (cost(&shards[0]), cost(&shards[1]));
        let largest = EXPECTED_SECONDS.iter().map(|(_, s)| *s).max().unwrap();
        assert!(a.abs_diff(b) <= largest, "{a} against {b}");
    }

    #[test]
    fn shards_keep_the_given_order_and_never_outnumber_the_binaries() {
        let all = vec![binary("upgrade", 2), binary("zeta", 1), binary("accel", 9)];
        let shards = split(&all, 5);
        assert_eq!(shards.len(), 3);
        let one = split(&all, 1);
        assert_eq!(names(&one[0]), ["upgrade", "zeta", "accel"]);
        let two = split(&all, 2);
        assert_eq!(names(&two[0]), ["upgrade"]);
        assert_eq!(names(&two[1]), ["zeta", "accel"]);
    }
}
