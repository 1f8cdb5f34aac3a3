//! The parity matrix, inbound half and the rest: every case runs against both backends in the
//! same run and must give the same outcome (where they differ by design, `Expect` says so per
//! case); then what only one backend does (the rules it writes, drop-invalid, the status port).

use std::process::Command;

use capture_tests::{
    cases::{default_inbound_cases, run_cases_on, run_matrix, Case, Expect::*, Scenario},
    guards::run,
    probe::Who,
    topology::{cgroup_programs, Topology},
};

#[test]
fn default_sidecar_inbound() {
    run_matrix(Scenario::with(&[]), &default_inbound_cases());
}

#[test]
fn no_listeners_means_refused_never_bypassed() {
    // T35, T36: with nothing on 15001/15006, captured connections are refused at once.
    fn remote_and_app(topo: &mut Topology) {
        topo.start_remote();
        topo.start_app();
    }
    run_matrix(
        Scenario {
            start: remote_and_app,
            ..Scenario::with(&[])
        },
        &[
            Case::new("T35", Who::app(), "10.0.0.5:80", Refused("ECONNREFUSED")),
            Case::new(
                "T35 v6",
                Who::app(),
                "[fd00:2::5]:80",
                Refused("ECONNREFUSED"),
            ),
            Case::remote("T36", "10.1.0.10:8080", Refused("ECONNREFUSED")),
            Case::remote("T36 v6", "[fd00:1::10]:8080", Refused("ECONNREFUSED")),
            Case::remote("T20 excluded port still served", "10.1.0.10:15020", App),
        ],
    );
}

#[test]
fn explicit_inbound_include_list_ignores_excludes() {
    // T45: -b 8080 -d 8080
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/includeInboundPorts=8080",
            "--annotation",
            "traffic.sidecar.istio.io/excludeInboundPorts=8080",
        ]),
        &[
            Case::remote("T45", "10.1.0.10:8080", Captured("10.1.0.10:8080")),
            Case::remote("T45 other port", "10.1.0.10:9090", App),
            Case::remote("T45 v6", "[fd00:1::10]:8080", Captured("[fd00:1::10]:8080")),
        ],
    );
}

#[test]
fn inbound_exclude_list_and_disabled_inbound() {
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/excludeInboundPorts=9090",
        ]),
        &[
            Case::remote("excluded", "10.1.0.10:9090", App),
            Case::remote("not excluded", "10.1.0.10:8080", Captured("10.1.0.10:8080")),
            Case::remote("status port default-excluded", "10.1.0.10:15020", App),
        ],
    );
    // -b '': no inbound capture at all, outbound unaffected (T81's inbound half).
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/includeInboundPorts=",
        ]),
        &[
            Case::remote("inbound off", "10.1.0.10:8080", App),
            Case::remote("inbound off v6", "[fd00:1::10]:8080", App),
            Case::new(
                "outbound still on",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "T81 proxy to own IP",
                Who::proxy(),
                "10.1.0.10:8080",
                Inbound("10.1.0.10:8080"),
            ),
        ],
    );
}

#[test]
fn status_port_annotation_moves_the_inbound_exclusion() {
    // The injector excludes 15090, 15021, the annotation's ports and the status port: with the
    // status port at 15999, 15020 is captured and 15999 is left alone (nothing listens there).
    run_matrix(
        Scenario::with(&["--annotation", "status.sidecar.istio.io/port=15999"]),
        &[
            Case::remote(
                "status port moved",
                "10.1.0.10:15020",
                Captured("10.1.0.10:15020"),
            ),
            Case::remote(
                "new status port excluded",
                "10.1.0.10:15999",
                Refused("ECONNREFUSED"),
            ),
            Case::remote("15021 still excluded", "10.1.0.10:15021", App),
        ],
    );
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
    let v4 = topo.nat_table("iptables-save");
    assert!(
        v4.contains(":ISTIO_OUTPUT") && v4.contains("-A OUTPUT -j ISTIO_OUTPUT"),
        "{v4}"
    );
    assert!(topo.nat_table("ip6tables-save").contains(":ISTIO_OUTPUT"));
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
        let table = topo.nat_table(tool);
        assert!(
            !table.contains("ISTIO"),
            "{tool} still shows Istio chains:\n{table}"
        );
    }
    run_cases_on(
        &topo,
        None,
        &[Case::new(
            "detached",
            Who::app(),
            "10.0.0.5:80",
            Remote("10.0.0.5:80"),
        )],
    );
}

#[test]
fn drop_invalid_is_a_mangle_rule_in_iptables_mode() {
    let topo = Topology::new();
    topo.attach(&["--mode", "iptables", "--drop-invalid"]);
    let mangle = |t: &Topology| {
        run(Command::new("ip").args([
            "netns",
            "exec",
            &t.pod.netns.name,
            "iptables-save",
            "-t",
            "mangle",
        ]))
    };
    assert!(
        mangle(&topo).contains("-A PREROUTING -m conntrack --ctstate INVALID -j ISTIO_DROP"),
        "{}",
        mangle(&topo)
    );
    assert!(topo.detach().status.success());
    assert!(
        !mangle(&topo).contains("INVALID"),
        "detach left the drop rule"
    );
    // Without NAT there is nothing for an invalid packet to slip past: ebpf accepts the flag.
    let ebpf = Topology::new();
    ebpf.attach(&["--mode", "ebpf", "--drop-invalid"]);
}
