//! Skips: a test that cannot check something on an old kernel says so on a line
//! `capture-skip: TEST<TAB>FEATURE<TAB>REASON`. That is fine on a kernel without FEATURE, and a
//! failure on one that has it (or for a feature nobody listed here), so a skip never hides a
//! regression.

use super::model::{KernelResult, Outcome, TestResult};

/// Kernel features tests may skip for, and the first kernel that has each: skipping on that kernel
/// or newer is a failure. A feature missing here is a failure too (add it with its version).
const FEATURES: [(&str, (u32, u32)); 5] = [
    // bpf_get_netns_cookie() callable from sock_ops programs.
    ("sock_ops_netns_cookie", (5, 15)),
    // A TCP socket's owner read from its file's credentials (needs the one above).
    ("owner_from_file", (5, 15)),
    // The stateless IPv4 redirect (needs the one above).
    ("stateless_redirect", (5, 15)),
    // The SO_NETNS_COOKIE socket option.
    ("so_netns_cookie", (5, 14)),
    // The acceleration's sk_msg program (socket-local storage read through an sk_msg's socket):
    // loads on every kernel of the matrix, 5.10 included.
    ("sk_msg_acceleration", (5, 10)),
];

/// Features of the node's set-up rather than the kernel: the guests mount cgroup v2 alone, so
/// they have these and a skip there fails, while on the host it is the machine's choice.
const NODE_FEATURES: [&str; 1] = [
    // Controllers on cgroup v2, which a hybrid host binds to v1 hierarchies instead.
    "unified_cgroup_controllers",
];

/// Gaps of the kernel matrix's guests rather than of a kernel, and the guests (by label) that have
/// them: a skip for one is accepted there only.
const HARNESS_GAPS: [(&str, &[&str]); 2] = [
    // runc 1.1 cannot re-execute itself from a sealed copy in the 5.10 guest, whose root is a 9p
    // mount chrooted on the initramfs ("could not ensure we are a cloned binary").
    ("runc_cloned_binary", &["5.10"]),
    // The guests' root is the host's, read only: the DaemonSet test cannot make the node paths
    // its hostPath volumes name (the host runs it).
    ("writable_node_paths", &["5.10", "6.1", "6.12"]),
];

/// Whether a kernel `release` (`5.10.0-32-amd64`) should have `feature`; `None` for a feature the
/// table does not know.
pub fn kernel_has(feature: &str, release: Option<&str>) -> Option<bool> {
    let (_, since) = FEATURES.iter().find(|(name, _)| *name == feature)?;
    let mut numbers = release?
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|n| n.parse::<u32>().ok());
    let version = (numbers.next()?, numbers.next()?);
    Some(version >= *since)
}

/// Turns the skip lines ([binary, test, feature, reason]) into skips or failures of their tests.
pub fn apply_skips(result: &mut KernelResult, skips: &[[String; 4]]) {
    for [binary, test, feature, reason] in skips {
        let gap = HARNESS_GAPS
            .iter()
            .find(|(name, _)| *name == feature.as_str());
        let expected = if NODE_FEATURES.contains(&feature.as_str()) {
            Some(result.kernel != super::HOST)
        } else if let Some((_, guests)) = gap {
            Some(!guests.contains(&result.kernel.as_str()))
        } else {
            kernel_has(feature, result.release.as_deref())
        };
        let verdict = match expected {
            Some(false) => (Outcome::Skip, format!("{feature}: {reason}")),
            Some(true) => (
                Outcome::Fail,
                format!("skipped for {feature}, which this kernel has: {reason}"),
            ),
            None => (
                Outcome::Fail,
                format!("skipped for unknown feature {feature}: {reason}"),
            ),
        };
        // The test is named as libtest names it, or binary::name.
        let found = result
            .tests
            .iter()
            .position(|t| {
                (t.binary == *binary && t.name == *test)
                    || *test == format!("{}::{}", t.binary, t.name)
            })
            .or_else(|| result.tests.iter().position(|t| t.name == *test));
        match found.map(|i| &mut result.tests[i]) {
            Some(t) if t.outcome == Outcome::Fail => {
                let also = format!("; also skipped {}", verdict.1);
                t.reason = Some(t.reason.take().unwrap_or_default() + &also);
            }
            Some(t) => (t.outcome, t.reason) = (verdict.0, Some(verdict.1)),
            None => result.tests.push(TestResult {
                binary: if binary.is_empty() { "?" } else { binary }.to_string(),
                name: test.clone(),
                outcome: verdict.0,
                reason: Some(verdict.1),
            }),
        }
    }
}
