//! The parity matrix, outbound half: the outbound cases of parity-spec.md section I and more from sections
//! C and E, IPv4 and IPv6, each scenario run against both backends on real traffic.

use capture_tests::{
    cases::{default_sidecar_cases, run_matrix, Case, Expect::*, Scenario},
    probe::{ConnectOpts, Who},
};

fn udp() -> ConnectOpts {
    ConnectOpts {
        udp: true,
        ..ConnectOpts::default()
    }
}

#[test]
fn default_sidecar() {
    run_matrix(Scenario::with(&[]), &default_sidecar_cases());
}

#[test]
fn udp_is_never_sent_to_the_proxy() {
    // T16, E6: UDP keeps its destination; the remote echo answers from it.
    run_matrix(
        Scenario::with(&[]),
        &[
            Case::new("T16", Who::app(), "10.0.0.5:5000", Remote("10.0.0.5:5000")).opts(udp()),
            Case::new(
                "T16 v6",
                Who::app(),
                "[fd00:2::5]:5000",
                Remote("[fd00:2::5]:5000"),
            )
            .opts(udp()),
        ],
    );
}

#[test]
fn include_outbound_cidrs() {
    // T40: only 10.0.0.0/8 goes to the proxy.
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundIPRanges=10.0.0.0/8,fd00:2::/120",
        ]),
        &[
            Case::new("T40", Who::app(), "1.1.0.5:80", Remote("1.1.0.5:80")),
            Case::new(
                "T40 included",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "v6 included",
                Who::app(),
                "[fd00:2::5]:80",
                Outbound("[fd00:2::5]:80"),
            ),
            Case::new(
                "v6 not included",
                Who::app(),
                "[fd00:2::1:5]:80",
                Remote("[fd00:2::1:5]:80"),
            ),
        ],
    );
}

#[test]
fn exclude_cidrs_rank_above_include_ports() {
    // T43: -x 10.2.0.0/16 -q 32000
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/excludeOutboundIPRanges=10.2.0.0/16,fd00:2::/64",
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundPorts=32000",
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundIPRanges=",
        ]),
        &[
            Case::new(
                "T43",
                Who::app(),
                "10.2.0.7:32000",
                Remote("10.2.0.7:32000"),
            ),
            Case::new(
                "T43 port included",
                Who::app(),
                "10.0.0.5:32000",
                Outbound("10.0.0.5:32000"),
            ),
            Case::new(
                "T43 nothing included",
                Who::app(),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
            Case::new(
                "v6 excluded",
                Who::app(),
                "[fd00:2::5]:32000",
                Remote("[fd00:2::5]:32000"),
            ),
        ],
    );
}

#[test]
fn exclude_outbound_ports_rank_first() {
    // T44: -o 5555 wins over everything, also for the proxy's own-pod rule.
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/excludeOutboundPorts=5555,8080",
        ]),
        &[
            Case::new("T44", Who::app(), "10.0.0.5:5555", Remote("10.0.0.5:5555")),
            Case::new(
                "T44 v6",
                Who::app(),
                "[fd00:2::5]:5555",
                Remote("[fd00:2::5]:5555"),
            ),
            Case::new(
                "T44 other port",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "excluded port beats proxy-to-own-IP",
                Who::proxy(),
                "10.1.0.10:8080",
                App,
            ),
        ],
    );
}

#[test]
fn several_proxy_uids_in_order() {
    // T72: -u 1337,1338: uid 1337's lo-RETURN rule catches 1338 towards the pod's own IP.
    run_matrix(
        Scenario::with(&["--proxy-uid", "1337,1338"]),
        &[
            Case::new("T72", Who::new(1338, 1338), "10.1.0.10:8080", App),
            Case::new(
                "T72 outbound",
                Who::new(1338, 1338),
                "10.0.0.5:80",
                Remote("10.0.0.5:80"),
            ),
            Case::new(
                "T72 first uid",
                Who::proxy(),
                "10.1.0.10:8080",
                Inbound("10.1.0.10:8080"),
            ),
        ],
    );
}

#[test]
fn loopback_include_cidr_is_captured() {
    // T73: -i 127.1.2.3/32 drops the lo-RETURN rules, so that range goes to the proxy.
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundIPRanges=127.1.2.3/32",
        ]),
        &[
            Case::new("T73", Who::app(), "127.1.2.3:80", Outbound("127.1.2.3:80")),
            Case::new("T73 other loopback", Who::app(), "127.0.0.2:9090", App),
        ],
    );
}

#[test]
fn proxy_to_own_pod_ip_with_nothing_included() {
    // T81: -b '' -i '' still sends the proxy's own-pod traffic to 15006.
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/includeInboundPorts=",
            "--annotation",
            "traffic.sidecar.istio.io/includeOutboundIPRanges=",
        ]),
        &[
            Case::new(
                "T81",
                Who::proxy(),
                "10.1.0.10:8080",
                Inbound("10.1.0.10:8080"),
            ),
            Case::new("T81 app", Who::app(), "10.0.0.5:80", Remote("10.0.0.5:80")),
        ],
    );
}

#[test]
fn ipv4_only_pod_leaves_ipv6_alone() {
    // Istio writes no ip6tables rules for a pod without an IPv6 address.
    let scenario = Scenario {
        pod_ips: &["10.1.0.10"],
        ..Scenario::with(&[])
    };
    run_matrix(
        scenario,
        &[
            Case::new(
                "v4 captured",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
            Case::new(
                "v6 untouched",
                Who::app(),
                "[fd00:2::5]:80",
                Remote("[fd00:2::5]:80"),
            ),
        ],
    );
}

#[test]
fn cni_default_port_exclusion() {
    // T37, E21: the CNI path excludes outbound 15020 when the annotation is absent; expressed here
    // as the annotation it amounts to.
    run_matrix(
        Scenario::with(&[
            "--annotation",
            "traffic.sidecar.istio.io/excludeOutboundPorts=15020",
        ]),
        &[Case::new(
            "T37",
            Who::app(),
            "10.0.0.5:15020",
            Remote("10.0.0.5:15020"),
        )],
    );
}

#[test]
fn ipv4_loopback_cidr_option() {
    // T77: with the whole 127/8 as "localhost", the validation probe to 127.0.0.6 stays local.
    run_matrix(
        Scenario::with(&["--ipv4-loopback-cidr", "127.0.0.1/8"]),
        &[
            Case::new(
                "T77",
                Who::proxy(),
                "127.0.0.6:15002",
                Refused("ECONNREFUSED"),
            )
            .opts(ConnectOpts {
                bind: Some("127.0.0.1:0".into()),
                ..Default::default()
            }),
            Case::new("T77 other 127/8", Who::proxy(), "127.0.0.2:9090", App),
            Case::new(
                "outbound unaffected",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
        ],
    );
}
