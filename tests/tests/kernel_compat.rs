//! The pieces that adapt capture to older kernels, checked on whatever kernel runs the suite
//! (the kernel matrix, `cargo xtask vm`, runs it on 5.10, 6.1 and 6.12 as well).

use std::path::Path;

use capture_tests::guards::NetnsGuard;
use capture_user::{ebpf::netns_cookie::netns_cookie, netns::Netns};

fn scratch_cgroups_left() -> Vec<String> {
    let root = capture_user::cgroup::cgroup2_mount().expect("cgroup v2 is mounted");
    std::fs::read_dir(root)
        .expect("the cgroup v2 root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("capture-netns-cookie-{}-", std::process::id())))
        .collect()
}

/// The BPF reporter (the only way before Linux 5.14) gives the cookie the kernel programs see:
/// the same as SO_NETNS_COOKIE where that exists, one per netns, stable, and it leaves nothing.
#[test]
fn the_bpf_netns_cookie_reporter_agrees_with_the_kernel() {
    capture_tests::require_root();
    let (a, b) = (
        NetnsGuard::new("capture-cookie"),
        NetnsGuard::new("capture-cookie"),
    );
    let open = |g: &NetnsGuard| Netns::open(&g.path()).expect("a fresh netns opens");
    let (na, nb) = (open(&a), open(&b));
    let reported_a = netns_cookie(na.file()).expect("the reporter answers for netns a");
    let reported_b = netns_cookie(nb.file()).expect("the reporter answers for netns b");
    assert_ne!(reported_a, 0);
    assert_ne!(reported_a, reported_b, "two netns, two cookies");
    assert_eq!(
        netns_cookie(na.file()).expect("asked again"),
        reported_a,
        "a netns keeps its cookie"
    );
    // What capture keys pods by: SO_NETNS_COOKIE where the kernel has it, else the reporter.
    assert_eq!(na.cookie().expect("Netns::cookie"), reported_a);
    let own = Netns::open(Path::new("/proc/self/ns/net")).expect("own netns");
    assert_ne!(netns_cookie(own.file()).expect("own netns"), reported_a);
    assert!(
        scratch_cgroups_left().is_empty(),
        "{:?}",
        scratch_cgroups_left()
    );
}
