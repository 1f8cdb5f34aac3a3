//! istio-cni's rule tests (`TestIPTablesRuleGeneration`, istio/istio
//! `cni/pkg/plugin/plugin_dryrun_test.go`) through capture's CNI path: each pod added (CNI ADD)
//! by the runtime-shaped caller through the real conflist, capture-cni asking the agent (`--mode
//! iptables`) with the pod's annotations, the proxy's ids from the agent's flags where istio-cni
//! takes them from the proxy container (`userspace/proxy_settings.rs` shows that source). The
//! rules in the pod's netns are compared with istio-cni's golden ones, both as `iptables-save`
//! lists them.

use capture_tests::{
    cni::{CgroupDriver, Node, MESHED},
    guards::{NetnsGuard, TempFile},
    istio_goldens::{apply, iptables_inputs, listed_iptables, GROUPS},
};

const TPROXY: (&str, &str) = ("sidecar.istio.io/interceptionMode", "TPROXY");

/// One agent's flags, and the cases (golden file, the pod's annotations) it serves.
type Group = (
    &'static [&'static str],
    &'static [(&'static str, &'static [(&'static str, &'static str)])],
);

const GROUPS_OF_CASES: &[Group] = &[
    (
        &[],
        &[
            ("basic", &[]),
            (
                "include-exclude-ip",
                &[
                    (
                        "traffic.sidecar.istio.io/includeOutboundIPRanges",
                        "127.0.0.0/8",
                    ),
                    (
                        "traffic.sidecar.istio.io/excludeOutboundIPRanges",
                        "10.0.0.0/8",
                    ),
                ],
            ),
            (
                "include-exclude-ports",
                &[
                    ("traffic.sidecar.istio.io/includeInboundPorts", "1111,2222"),
                    ("traffic.sidecar.istio.io/excludeInboundPorts", "3333,4444"),
                    ("traffic.sidecar.istio.io/excludeOutboundPorts", "5555,6666"),
                ],
            ),
            ("tproxy", &[TPROXY]),
        ],
    ),
    (&["--redirect-dns"], &[("dns", &[])]),
    (&["--drop-invalid"], &[("invalid-drop", &[])]),
    (
        &["--proxy-uid", "1000670000", "--proxy-gid", "1000670001"],
        &[("custom-uid", &[]), ("custom-uid-tproxy", &[TPROXY])],
    ),
];

#[test]
fn istio_cnis_dry_runs_through_capture_cni() {
    let groups = TempFile::new("istio-golden-groups", GROUPS);
    let mut differing = Vec::new();
    for (flags, cases) in GROUPS_OF_CASES {
        let node = Node::new();
        node.install_cni();
        let mut args = vec!["--fallback", "iptables"];
        args.extend(*flags);
        let mut agent = node.start_agent_with("iptables", &args);
        for (golden, annotations) in *cases {
            let all: Vec<(&str, &str)> = MESHED.iter().chain(annotations.iter()).copied().collect();
            let mut pod = node.pod(golden, CgroupDriver::Cgroupfs, &all);
            node.add(&mut pod)
                .unwrap_or_else(|e| panic!("ADD {golden}: {e}"));
            let istio = NetnsGuard::new("istio-cni-golden");
            apply(&istio.path(), &iptables_inputs("cni", golden), &groups.path);
            let (want, got) = (
                listed_iptables(&istio.path(), &groups.path),
                listed_iptables(&pod.netns.path(), &groups.path),
            );
            if want != got {
                differing.push(format!(
                    "== {golden}\n-- istio-cni:\n{want}-- capture:\n{got}"
                ));
            }
            node.del(&pod)
                .unwrap_or_else(|e| panic!("DEL {golden}: {e}"));
        }
        agent.stop();
    }
    assert!(differing.is_empty(), "{}", differing.join("\n"));
}
