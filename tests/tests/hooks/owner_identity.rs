//! Whose socket is it. iptables' owner match compares the socket file's fsuid and fsgid (the
//! creator's effective ids, unless it called setfsuid). The ebpf programs read the same for a
//! TCP socket where the kernel lets them walk to the file's credentials (`owner_from_file`,
//! Linux 5.15 and newer); elsewhere they compare the creator's real ids, recorded when the socket
//! is created. Both agree for every process whose ids are not split, the proxy run as uid 1337 as
//! Istio's injector runs it among them. Where ids are split, these tests pin the answers down
//! (docs/how-it-works/semantics.md, "Owner identity").

use capture_tests::{
    cases::{run_cases_on, Backend, Case, Expect},
    kernel::{has_or_skip, Feature},
    probe::Who,
    topology::Topology,
};

/// Real root, effective proxy (seteuid(1337) from root, a setuid-1337 binary); real proxy,
/// effective root (a setuid-root binary the proxy runs); and unsplit ids, judged alike by all.
fn split_id_cases(as_effective_proxy: Expect, as_effective_root: Expect) -> [Case; 4] {
    [
        Case::new(
            "real root, effective 1337",
            Who::new(0, 0).with_effective(1337, 1337),
            "10.0.0.5:80",
            as_effective_proxy,
        ),
        Case::new(
            "real 1337, effective root",
            Who::proxy().with_effective(0, 0),
            "10.0.0.5:80",
            as_effective_root,
        ),
        Case::new(
            "proxy",
            Who::proxy(),
            "10.0.0.5:80",
            Expect::Remote("10.0.0.5:80"),
        ),
        Case::new(
            "app",
            Who::app(),
            "10.0.0.5:80",
            Expect::Outbound("10.0.0.5:80"),
        ),
    ]
}

fn run_split_ids(backend: Backend, env: Option<(&'static str, &str)>, cases: &[Case]) {
    let mut topo = Topology::new();
    if let Some((name, value)) = env {
        topo.capture_env.push((name, value.to_string()));
    }
    topo.attach(&["--mode", backend.mode()]);
    topo.start_all();
    run_cases_on(&topo, Some(backend), cases);
}

/// Where the programs read the owner from the socket, ebpf judges split ids exactly as iptables:
/// by the effective ids the socket's file was opened with.
#[test]
fn split_ids_are_judged_by_the_sockets_file_under_both_backends() {
    let exact = split_id_cases(
        Expect::Remote("10.0.0.5:80"),
        Expect::Outbound("10.0.0.5:80"),
    );
    run_split_ids(Backend::Iptables, None, &exact);
    if has_or_skip(
        Feature::OwnerFromFile,
        "the programs record owners at socket creation here; see the test below",
    ) {
        run_split_ids(Backend::Ebpf, None, &exact);
    }
}

/// Where owners are recorded at creation (forced here, as on a kernel without the walk), ebpf
/// judges by real ids: a setuid-1337 binary cannot slip past capture as it slips past iptables',
/// and a proxy must run with its real uid, not only its effective one, to be exempt.
#[test]
fn recorded_owners_are_judged_by_real_ids() {
    let recorded = split_id_cases(
        Expect::Outbound("10.0.0.5:80"),
        Expect::Remote("10.0.0.5:80"),
    );
    run_split_ids(
        Backend::Ebpf,
        Some(("CAPTURE_RECORD_OWNERS", "1")),
        &recorded,
    );
}
