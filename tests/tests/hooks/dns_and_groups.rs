//! The parity matrix, DNS capture and owner groups (parity-spec.md C, E.13, E.16): both backends.

use capture_tests::{
    cases::{run_matrix, Case, Expect::*, Scenario},
    probe::{ConnectOpts, Who},
    topology::Topology,
};

fn udp() -> ConnectOpts {
    ConnectOpts {
        udp: true,
        ..ConnectOpts::default()
    }
}

fn with_dns_proxy(topo: &mut Topology) {
    topo.start_all();
    topo.start_dns_proxy();
}

#[test]
fn dns_to_the_nameservers() {
    // istio-init's mode: only resolv.conf's nameservers are captured (T47, T50).
    run_matrix(
        Scenario {
            start: with_dns_proxy,
            ..Scenario::with(&[
                "--redirect-dns",
                "--dns-nameserver",
                "10.96.0.10",
                "--dns-nameserver",
                "fd00:2::5",
            ])
        },
        &[
            Case::new("T47", Who::app(), "10.96.0.10:53", Dns("10.96.0.10:53")).opts(udp()),
            Case::new(
                "T47 over TCP",
                Who::app(),
                "10.96.0.10:53",
                Dns("10.96.0.10:53"),
            ),
            Case::new(
                "T47 v6",
                Who::app(),
                "[fd00:2::5]:53",
                Dns("[fd00:2::5]:53"),
            )
            .opts(udp()),
            Case::new(
                "T50",
                Who::proxy(),
                "10.96.0.10:53",
                Remote("10.96.0.10:53"),
            )
            .opts(udp()),
            Case::new(
                "not a nameserver",
                Who::app(),
                "10.0.0.5:53",
                Remote("10.0.0.5:53"),
            )
            .opts(udp()),
            Case::new(
                "T16 other UDP",
                Who::app(),
                "10.0.0.5:5000",
                Remote("10.0.0.5:5000"),
            )
            .opts(udp()),
            Case::new(
                "TCP still captured",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
        ],
    );
}

#[test]
fn dns_capture_all() {
    // The CNI path's mode: every port-53 destination (T52).
    run_matrix(
        Scenario {
            start: with_dns_proxy,
            ..Scenario::with(&["--redirect-dns", "--capture-all-dns"])
        },
        &[
            Case::new("T52", Who::app(), "10.0.0.5:53", Dns("10.0.0.5:53")).opts(udp()),
            Case::new(
                "T52 nameserver",
                Who::app(),
                "10.96.0.10:53",
                Dns("10.96.0.10:53"),
            )
            .opts(udp()),
            Case::new(
                "T50 proxy",
                Who::proxy(),
                "10.0.0.5:53",
                Remote("10.0.0.5:53"),
            )
            .opts(udp()),
        ],
    );
}

#[test]
fn a_pod_can_turn_dns_capture_off() {
    run_matrix(
        Scenario {
            start: with_dns_proxy,
            ..Scenario::with(&[
                "--redirect-dns",
                "--capture-all-dns",
                "--annotation",
                "proxy.istio.io/config=proxyMetadata:\n  ISTIO_META_DNS_CAPTURE: \"false\"\n",
            ])
        },
        &[Case::new(
            "off by annotation",
            Who::app(),
            "10.0.0.5:53",
            Remote("10.0.0.5:53"),
        )
        .opts(udp())],
    );
}

#[test]
fn owner_groups_include() {
    // T75: only the listed primary groups are captured.
    run_matrix(
        Scenario::with(&["--owner-groups", "1000"]),
        &[
            Case::new(
                "T75 listed",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "T75 not listed",
                Who::new(2000, 2000),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
            Case::new(
                "supplementary does not count",
                Who::new(2000, 2000).with_groups(&[1000]),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
        ],
    );
}

#[test]
fn owner_groups_exclude() {
    // T76: every group but the listed ones.
    run_matrix(
        Scenario::with(&["--owner-groups-exclude", "1000"]),
        &[
            Case::new(
                "T76 excluded",
                Who::app(),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
            Case::new(
                "T76 other",
                Who::new(2000, 2000),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
        ],
    );
}
