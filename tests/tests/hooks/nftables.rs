//! The nftables backend's own duties, beyond the parity matrix's answers: Istio's tables and
//! nothing else in the pod's netns, gone after detach; a table of the same name it did not write
//! refused and named; a missing rule seen by `status`; a pod without IPv6 left alone on IPv6, as
//! the iptables backend leaves it.

use std::process::Command;

use capture_tests::{
    guards::{output_text, run, TempFile},
    probe::Who,
    topology::{cgroup_programs, Topology, POD_IP4},
};

fn nft(topo: &Topology, args: &[&str]) -> String {
    run(Command::new("ip")
        .args(["netns", "exec", &topo.pod.netns.name, "nft"])
        .args(args))
}

fn tables(topo: &Topology) -> String {
    nft(topo, &["list", "tables"])
}

#[test]
fn nftables_mode_writes_and_removes_exactly_its_tables() {
    let mut topo = Topology::new();
    topo.attach(&["--mode", "nftables", "--drop-invalid"]);
    topo.start_all();
    assert!(cgroup_programs(&topo.pod.cgroup.path).is_empty());
    assert_eq!(
        tables(&topo).lines().collect::<Vec<_>>(),
        [
            "table inet istio-proxy-mangle",
            "table inet istio-proxy-nat"
        ],
    );
    for save in ["iptables-save", "ip6tables-save"] {
        assert!(!topo.nat_table(save).contains("ISTIO"), "no iptables rules");
    }
    let status = topo.status();
    assert_eq!(status["pods"][0]["mode"], "nftables");
    assert_eq!(status["pods"][0]["in_force"], true, "{status}");
    topo.tcp(&Who::app(), "10.0.0.5:80")
        .assert_served_by("outbound", "captured");

    // A rule gone is capture not in force, and status names the chain.
    let listing = nft(
        &topo,
        &[
            "-a",
            "list",
            "chain",
            "inet",
            "istio-proxy-nat",
            "istio-output",
        ],
    );
    let handle = listing
        .lines()
        .find(|l| l.contains("jump istio-redirect"))
        .and_then(|l| l.rsplit_once("# handle "))
        .map(|(_, h)| h.trim().to_owned())
        .expect("the include-all rule");
    nft(
        &topo,
        &[
            "delete",
            "rule",
            "inet",
            "istio-proxy-nat",
            "istio-output",
            "handle",
            &handle,
        ],
    );
    let status = topo.status();
    assert_eq!(status["pods"][0]["in_force"], false, "{status}");
    assert!(status.to_string().contains("istio-output"), "{status}");

    assert!(topo.detach().status.success());
    assert_eq!(tables(&topo), "", "detach leaves no table");
    topo.tcp(&Who::app(), "10.0.0.5:80")
        .assert_served_by("remote", "detached");
}

#[test]
fn a_table_of_istios_names_it_did_not_write_is_refused() {
    let topo = Topology::new();
    nft(&topo, &["add", "table", "inet", "istio-proxy-nat"]);
    nft(&topo, &["add", "chain", "inet", "istio-proxy-nat", "mine"]);
    let out = topo.try_attach(&["--mode", "nftables"]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("istio-proxy-nat") && err.contains("--take-over-istio-rules"),
        "{err}"
    );
    assert_eq!(topo.status()["pods"].as_array().map_or(0, Vec::len), 0);
    // What was there is left as it was.
    assert!(nft(&topo, &["list", "table", "inet", "istio-proxy-nat"]).contains("chain mine"));
}

#[test]
fn a_pod_without_ipv6_is_left_alone_on_ipv6() {
    for mode in ["iptables", "nftables"] {
        let mut topo = Topology::new();
        let out = topo.try_attach_with_ips(&[POD_IP4], &["--mode", mode]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        topo.start_all();
        topo.tcp(&Who::app(), "10.0.0.5:80")
            .assert_served_by("outbound", mode);
        // The netns has IPv6 although attach was told no IPv6 address: no ip6tables rules under
        // iptables, and nftables lets IPv6 through its tables.
        topo.tcp(&Who::app(), "[fd00:2::5]:80")
            .assert_served_by("remote", mode);
    }
}

/// A node without the iptables tools (RHEL 10's): capture sees only what is on its PATH, here
/// nft and the other commands it runs, but no iptables.
#[test]
fn auto_falls_back_to_nftables_where_the_iptables_tools_are_absent() {
    let bin = TempFile::new("README", "commands capture may run, iptables left out");
    let dir = bin.path.parent().unwrap().to_path_buf();
    let path = std::env::var_os("PATH").unwrap_or_default();
    for tool in ["nft", "ip", "nsenter", "cat", "sysctl"] {
        let found = std::env::split_paths(&path)
            .map(|d| d.join(tool))
            .find(|f| f.is_file())
            .unwrap_or_else(|| panic!("{tool} is not on the PATH"));
        std::os::unix::fs::symlink(found, dir.join(tool)).unwrap();
    }
    let mut topo = Topology::new();
    topo.capture_env
        .push(("PATH", dir.to_string_lossy().into_owned()));
    let doctor = output_text(&topo.capture(&["doctor"]));
    assert!(
        doctor.contains("iptables backend: NOT usable")
            && doctor.contains("nftables backend: usable")
            && doctor.contains("pods that fall back would use nftables")
            && doctor.contains("the iptables tools are not installed"),
        "{doctor}"
    );
    topo.attach(&[
        "--mode",
        "auto",
        "--annotation",
        "sidecar.istio.io/interceptionMode=TPROXY",
    ]);
    topo.start_remote();
    topo.start_app();
    topo.start_tproxy_proxy();
    topo.connect_from_remote("10.1.0.10:8080")
        .assert_served_by("inbound", "TPROXY on nftables");
    let pod = &topo.status()["pods"][0];
    assert_eq!(pod["mode"], "nftables", "{pod}");
}
