//! The iptables backend on real traffic, and the first parity check: the same outbound cases
//! give the same outcome under `--mode iptables` and `--mode ebpf`.

use std::process::Command;

use capture_tests::{
    cases::{default_sidecar_cases, run_cases, Case, Expect::*},
    guards::run,
    probe::Who,
    topology::{cgroup_programs, Topology},
};

fn nat_table(topo: &Topology, tool: &str) -> String {
    run(Command::new("ip").args(["netns", "exec", &topo.pod.netns.name, tool, "-t", "nat"]))
}

#[test]
fn outbound_parity_between_backends() {
    for mode in ["iptables", "ebpf"] {
        let mut topo = Topology::new();
        topo.attach(&["--mode", mode]);
        topo.start_all();
        run_cases(&topo, &default_sidecar_cases());
    }
}

#[test]
fn iptables_mode_writes_and_removes_exactly_its_rules() {
    let mut topo = Topology::new();
    topo.attach(&["--mode", "iptables"]);
    topo.start_all();
    assert!(
        cgroup_programs(&topo.pod.cgroup.path).is_empty(),
        "iptables mode attaches no programs"
    );
    let v4 = nat_table(&topo, "iptables-save");
    assert!(
        v4.contains(":ISTIO_OUTPUT") && v4.contains("-A OUTPUT -j ISTIO_OUTPUT"),
        "{v4}"
    );
    assert!(nat_table(&topo, "ip6tables-save").contains(":ISTIO_OUTPUT"));
    let status = topo.status();
    assert_eq!(status["pods"][0]["mode"], "iptables");
    assert_eq!(status["pods"][0]["in_force"], true, "{status}");

    // A second backend on the same pod is an error, not a double capture.
    let out = topo.try_attach(&["--mode", "ebpf"]);
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already captured"));
    assert!(cgroup_programs(&topo.pod.cgroup.path).is_empty());

    let out = topo.detach();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for tool in ["iptables-save", "ip6tables-save"] {
        let table = nat_table(&topo, tool);
        assert!(
            !table.contains("ISTIO"),
            "{tool} still shows Istio chains:\n{table}"
        );
    }
    run_cases(
        &topo,
        &[Case::new(
            "detached",
            Who::app(),
            "10.0.0.5:80",
            Remote("10.0.0.5:80"),
        )],
    );
}
