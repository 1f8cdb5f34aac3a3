//! The iptables backend on real traffic, and the first parity check: the same outbound cases
//! give the same outcome under `--mode iptables` and `--mode ebpf`.

use std::process::Command;

use capture_tests::{
    cases::{run_cases, Case, Expect::*},
    guards::run,
    probe::{ConnectOpts, Who},
    topology::{cgroup_programs, Topology},
};

fn outbound_cases() -> Vec<Case> {
    let (app, proxy) = (Who::app, Who::proxy);
    vec![
        Case::new("T01", app(), "10.0.0.5:80", Outbound("10.0.0.5:80")).peer("10.1.0.10"),
        Case::new("T04", proxy(), "10.0.0.5:80", Remote("10.0.0.5:80")),
        Case::new(
            "T05",
            Who::new(2000, 1337),
            "10.0.0.5:80",
            Remote("10.0.0.5:80"),
        ),
        Case::new("T06", app(), "127.0.0.1:9090", App),
        Case::new("T07", app(), "10.1.0.10:8080", App).peer("10.1.0.10"),
        Case::new("T09", proxy(), "10.1.0.10:8080", Inbound("10.1.0.10:8080")).peer("10.1.0.10"),
        Case::new("T15", proxy(), "127.0.0.2:8080", Inbound("127.0.0.2:8080")).peer("127.0.0.1"),
        Case::new("T18", app(), "10.0.0.5:15020", Outbound("10.0.0.5:15020")),
        Case::new("T83", app(), "10.0.0.5:80", Remote("10.0.0.5:80")).opts(ConnectOpts {
            create_as: Some((1337, 1337)),
            ..ConnectOpts::default()
        }),
        Case::new(
            "T85",
            Who::app().with_groups(&[1337]),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        ),
        Case::new("T29", app(), "[fd00:2::5]:80", Outbound("[fd00:2::5]:80")).peer("fd00:1::10"),
        Case::new(
            "v6 proxy to own IP",
            proxy(),
            "[fd00:1::10]:8080",
            Inbound("[fd00:1::10]:8080"),
        ),
    ]
}

fn nat_table(topo: &Topology, tool: &str) -> String {
    run(Command::new("ip").args(["netns", "exec", &topo.pod.netns.name, tool, "-t", "nat"]))
}

#[test]
fn outbound_parity_between_backends() {
    for mode in ["iptables", "ebpf"] {
        let mut topo = Topology::new();
        topo.attach(&["--mode", mode]);
        topo.start_all();
        run_cases(&topo, &outbound_cases());
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
