//! Pods whose netns already holds Istio's own capture rules: a cluster migrating from istio-init
//! has them. The rules here are istio-init's as the iptables (or nftables) backend writes them
//! with Istio's defaults, by a capture of another state directory, which leaves no record of
//! them behind, as istio-init leaves none. Under ebpf they are refused (or replaced when asked);
//! a rule backend adopts them only when they are exactly its own.

use std::process::Command;

use capture_tests::{
    guards::{output_text, run, CaptureDirs},
    probe::Who,
    topology::{capture_bin, cgroup_programs, Topology, POD_IP4, POD_IP6},
};

/// istio-init: the pod's rules written by a capture that keeps no record of them here.
fn istio_init(topo: &Topology, mode: &str) {
    let elsewhere = CaptureDirs::new();
    let netns = topo.pod.netns.path();
    let out = Command::new(capture_bin())
        .arg("--bpffs")
        .arg(&elsewhere.bpffs)
        .arg("--state-dir")
        .arg(&elsewhere.state)
        .args(["attach", "--netns", netns.to_str().unwrap(), "--cgroup"])
        .arg(&topo.pod.cgroup.path)
        .args(["--pod-ip", POD_IP4, "--pod-ip", POD_IP6, "--mode", mode])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", output_text(&out));
}

fn nft_tables(topo: &Topology) -> String {
    run(Command::new("ip").args([
        "netns",
        "exec",
        &topo.pod.netns.name,
        "nft",
        "list",
        "tables",
    ]))
}

/// A CNI ADD asks the kernel for the pod's nftables tables itself: it must see what nft lists,
/// in every family, including Istio's `inet` tables and the `ip`/`ip6` tables iptables-nft
/// writes.
#[test]
fn the_tables_a_capture_asks_the_kernel_for_are_those_nft_lists() {
    let topo = Topology::new();
    let netns = topo.pod.netns.path().to_str().unwrap().to_owned();
    let mut families = [
        ("ip", "nat"),
        ("ip6", "mangle"),
        ("inet", "istio-proxy-nat"),
        ("inet", "another"),
        ("arp", "a"),
        ("bridge", "b"),
    ];
    let script: String = families
        .iter()
        .map(|(family, name)| format!("add table {family} {name}\n"))
        .collect();
    let nft = |args: &[&str], input: &str| {
        let out = capture_user::netns::output_in(
            std::path::Path::new(&netns),
            Command::new("nft").args(args),
            input.as_bytes(),
        )
        .unwrap();
        assert!(out.status.success(), "{}", output_text(&out));
        String::from_utf8(out.stdout).unwrap()
    };
    nft(&["-f", "-"], &script);
    let listing: serde_json::Value =
        serde_json::from_str(&nft(&["-j", "list", "tables"], "")).unwrap();
    let mut listed: Vec<(String, String)> = listing["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| {
            let t = o.get("table")?;
            Some((
                t["family"].as_str()?.to_owned(),
                t["name"].as_str()?.to_owned(),
            ))
        })
        .collect();
    let ns = capture_user::netns::Netns::open(&topo.pod.netns.path()).unwrap();
    let mut asked: Vec<(String, String)> = capture_user::nf_tables::tables(&ns)
        .unwrap()
        .into_iter()
        .map(|t| (t.family.to_owned(), t.name))
        .collect();
    listed.sort();
    asked.sort();
    families.sort_unstable();
    assert_eq!(asked, listed);
    let expected: Vec<(String, String)> = families
        .iter()
        .map(|(f, n)| ((*f).to_owned(), (*n).to_owned()))
        .collect();
    assert_eq!(asked, expected);
}

fn pods(topo: &Topology) -> usize {
    topo.status()["pods"].as_array().map_or(0, Vec::len)
}

#[test]
fn ebpf_refuses_istio_inits_rules_and_replaces_them_when_asked() {
    let mut topo = Topology::new();
    istio_init(&topo, "iptables");
    let out = topo.try_attach(&["--mode", "ebpf"]);
    let err = output_text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("ISTIO_OUTPUT")
            && err.contains("istio-init")
            && err.contains("--take-over-istio-rules"),
        "{err}"
    );
    assert_eq!(pods(&topo), 0);
    assert!(cgroup_programs(&topo.pod.cgroup.path).is_empty());

    topo.attach(&["--mode", "ebpf", "--take-over-istio-rules"]);
    for save in ["iptables-save", "ip6tables-save"] {
        let nat = topo.nat_table(save);
        assert!(
            !nat.contains("ISTIO"),
            "{save} still holds Istio's chains:\n{nat}"
        );
    }
    assert!(!cgroup_programs(&topo.pod.cgroup.path).is_empty());
    topo.start_all();
    topo.tcp(&Who::app(), "10.0.0.5:80")
        .assert_served_by("outbound", "taken over");
}

#[test]
fn a_rule_backend_adopts_its_own_rules_and_refuses_others() {
    for mode in ["iptables", "nftables"] {
        let mut topo = Topology::new();
        istio_init(&topo, mode);
        let other = topo.try_attach(&[
            "--mode",
            mode,
            "--annotation",
            "traffic.sidecar.istio.io/excludeOutboundPorts=5432",
        ]);
        let err = output_text(&other);
        assert!(!other.status.success(), "{mode}: {err}");
        assert!(err.contains("differ from capture's"), "{mode}: {err}");
        assert_eq!(pods(&topo), 0);

        topo.attach(&["--mode", mode]);
        let pod = &topo.status()["pods"][0];
        assert_eq!(pod["mode"], mode, "{pod}");
        assert_eq!(pod["in_force"], true, "{pod}");
        topo.start_all();
        topo.tcp(&Who::app(), "10.0.0.5:80")
            .assert_served_by("outbound", mode);
        assert!(topo.detach().status.success());
        assert!(!topo.nat_table("iptables-save").contains("ISTIO"), "{mode}");
        // iptables-nft leaves its empty nat tables; no table of Istio's stays.
        assert!(!nft_tables(&topo).contains("istio-proxy"), "{mode}");
    }
}

#[test]
fn another_kind_of_istio_rules_is_refused_then_replaced() {
    let topo = Topology::new();
    istio_init(&topo, "iptables");
    let out = topo.try_attach(&["--mode", "nftables"]);
    let err = output_text(&out);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("ISTIO_") && err.contains("iptables chains are there too"),
        "{err}"
    );
    topo.attach(&["--mode", "nftables", "--take-over-istio-rules"]);
    assert!(!topo.nat_table("iptables-save").contains("ISTIO"));
    assert!(nft_tables(&topo).contains("istio-proxy-nat"));
}
