//! Whose socket is it. iptables' owner match compares the socket file's fsuid and fsgid (the
//! creator's effective ids, unless it called setfsuid); the ebpf programs compare the creator's
//! real ids, all the kernel tells a socket program. The two agree for every process whose ids are
//! not split, the proxy run as uid 1337 as Istio's injector runs it among them. Where a process's
//! ids are split they judge it differently, and this test pins the difference down (README,
//! "Owner identity"): a setuid-1337 binary cannot slip past ebpf capture as it slips past
//! iptables', and a proxy must run with its real uid, not only its effective one, to be exempt.

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect::*},
    probe::Who,
    topology::Topology,
};

#[test]
fn split_ids_are_judged_by_effective_ids_under_iptables_and_by_real_ids_under_ebpf() {
    for backend in Backend::ALL {
        let mut topo = Topology::new();
        topo.attach(&["--mode", backend.mode()]);
        topo.start_all();
        // Real root, effective proxy (seteuid(1337) from root, a setuid-1337 binary).
        let effective_proxy = Who::new(0, 0).with_effective(1337, 1337);
        // Real proxy, effective root (a setuid-root binary the proxy runs).
        let effective_root = Who::proxy().with_effective(0, 0);
        let (as_effective_proxy, as_effective_root) = match backend {
            Backend::Iptables => (Remote("10.0.0.5:80"), Outbound("10.0.0.5:80")),
            Backend::Ebpf => (Outbound("10.0.0.5:80"), Remote("10.0.0.5:80")),
        };
        run_cases_on(
            &topo,
            Some(backend),
            &[
                Case::new(
                    "real root, effective 1337",
                    effective_proxy,
                    "10.0.0.5:80",
                    as_effective_proxy,
                ),
                Case::new(
                    "real 1337, effective root",
                    effective_root,
                    "10.0.0.5:80",
                    as_effective_root,
                ),
                // Unsplit ids: the same under both.
                Case::new("proxy", Who::proxy(), "10.0.0.5:80", Remote("10.0.0.5:80")),
                Case::new("app", Who::app(), "10.0.0.5:80", Outbound("10.0.0.5:80")),
            ],
        );
    }
}
