//! The pieces that adapt capture to older kernels, checked on whatever kernel runs the suite
//! (the kernel matrix, `cargo xtask vm`, runs it on 5.10, 6.1 and 6.12 as well).

use std::path::Path;

use capture_tests::{
    cases::{run_cases, Case, Expect::*},
    guards::NetnsGuard,
    probe::{ConnectOpts, Who},
    topology::{cgroup_programs, Topology, POD_CGROUP_HOOKS},
};
use capture_user::{ebpf::netns_cookie::netns_cookie, netns::Netns};

fn scratch_cgroups_left(purpose: &str) -> Vec<String> {
    scratch_cgroups_left_by(purpose, std::process::id())
}

/// The scratch cgroups of `purpose` that process `pid` made and left.
fn scratch_cgroups_left_by(purpose: &str, pid: u32) -> Vec<String> {
    let root = capture_user::cgroup::cgroup2_mount().expect("cgroup v2 is mounted");
    let prefix = format!("capture-{purpose}-{pid}-");
    std::fs::read_dir(root)
        .expect("the cgroup v2 root")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&prefix))
        .collect()
}

/// The BPF reporter (the only way before Linux 5.14) gives the cookie the kernel programs see:
/// the same as `SO_NETNS_COOKIE` where that exists, one per netns, stable, and it leaves nothing.
#[test]
fn the_bpf_netns_cookie_reporter_agrees_with_the_kernel() {
    capture_tests::require_root();
    let (a, b) = (
        NetnsGuard::new("capture-cookie"),
        NetnsGuard::new("capture-cookie"),
    );
    let open = |g: &NetnsGuard| Netns::open(&g.path()).expect("a fresh netns opens");
    let (na, nb) = (open(&a), open(&b));
    let reported_a = netns_cookie(na.file()).expect("the reporter answers for netns a");
    let reported_b = netns_cookie(nb.file()).expect("the reporter answers for netns b");
    assert_ne!(reported_a, 0);
    assert_ne!(reported_a, reported_b, "two netns, two cookies");
    assert_eq!(
        netns_cookie(na.file()).expect("asked again"),
        reported_a,
        "a netns keeps its cookie"
    );
    // What capture keys pods by: SO_NETNS_COOKIE where the kernel has it, else the reporter.
    assert_eq!(na.cookie(netns_cookie).expect("Netns::cookie"), reported_a);
    let own = Netns::open(Path::new("/proc/self/ns/net")).expect("own netns");
    assert_ne!(netns_cookie(own.file()).expect("own netns"), reported_a);
    let left = scratch_cgroups_left("netns-cookie");
    assert!(left.is_empty(), "{left:?}");
}

/// Whether the cgroup2 hierarchy has `nsdelegate`.
fn nsdelegate() -> bool {
    std::fs::read_to_string("/proc/self/mounts")
        .unwrap_or_default()
        .lines()
        .any(|l| l.split_whitespace().nth(2) == Some("cgroup2") && l.contains("nsdelegate"))
}

/// `nsdelegate` on the cgroup2 hierarchy while it lives, in a kernel-matrix guest only: the flag
/// is the whole hierarchy's, which a test may change on a disposable machine and not on a host.
struct NsdelegateInGuest {
    mount: Option<std::path::PathBuf>,
}

impl NsdelegateInGuest {
    fn enable() -> Self {
        if nsdelegate() || std::env::var_os("CAPTURE_VM_GUEST").is_none() {
            return Self { mount: None };
        }
        let mount = capture_user::cgroup::cgroup2_mount().expect("cgroup v2");
        let status = std::process::Command::new("mount")
            .args(["-o", "remount,nsdelegate"])
            .arg(&mount)
            .status()
            .expect("mount");
        assert!(
            status.success() && nsdelegate(),
            "remounting cgroup2 with nsdelegate"
        );
        Self { mount: Some(mount) }
    }
}

impl Drop for NsdelegateInGuest {
    fn drop(&mut self) {
        if let Some(mount) = &self.mount {
            // A cgroup2 remount without the option clears it.
            let _ = std::process::Command::new("mount")
                .args(["-o", "remount"])
                .arg(mount)
                .status();
        }
    }
}

/// The reporter from a cgroup namespace of its own, as the agent runs in a DaemonSet pod under
/// containerd on cgroup v2: where cgroup2 is mounted with `nsdelegate` (systemd's default), such
/// a process may not move its child into the scratch cgroup at the root unless the child enters
/// the node's cgroup namespace. The kernel matrix's guests turn `nsdelegate` on for this test;
/// a host without it runs the same steps, which cannot be refused there.
#[test]
fn the_reporter_answers_from_a_cgroup_namespace_of_its_own() {
    capture_tests::require_root();
    let pod = NetnsGuard::new("capture-cookie");
    let expected = Netns::open(&pod.path())
        .and_then(|n| n.cookie(netns_cookie))
        .expect("the netns's cookie");
    let _nsdelegate = NsdelegateInGuest::enable();
    eprintln!("cgroup2 mounted with nsdelegate: {}", nsdelegate());
    // A container's cgroup, not the root: a namespace rooted at the root sees every cgroup.
    // The shell joins it, then unshare starts the namespace there and execs the probe in the
    // same process, whose pid names the scratch cgroup.
    let container = capture_tests::guards::CgroupGuard::new("capture-agent-container");
    let join_then_exec = format!(
        "echo $$ > {} && exec \"$@\"",
        container.path.join("cgroup.procs").display()
    );
    let child = std::process::Command::new("bash")
        .args(["-c", &join_then_exec, "join"])
        .args(["unshare", "--cgroup"])
        .arg(capture_tests::probe::probe_bin())
        .args(["netns-cookie", "--of"])
        .arg(pod.path())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("running unshare");
    let pid = child.id();
    let out = child.wait_with_output().expect("the probe's output");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "the reporter failed: {stderr}");
    let reported: u64 = String::from_utf8_lossy(&out.stdout)
        .trim()
        .parse()
        .unwrap_or_else(|e| panic!("{e}: {stderr}"));
    assert_eq!(reported, expected, "{stderr}");
    let left = scratch_cgroups_left_by("netns-cookie", pid);
    assert!(
        left.is_empty(),
        "the probe's scratch cgroup is gone: {left:?}"
    );
}

/// A kernel without a hook only some pods need (here the DNS hooks, refused on purpose, since
/// every kernel in the matrix has them): in auto mode those pods fall back to iptables and say
/// which hook was missing, and their traffic is still captured; the other pods keep ebpf.
#[test]
fn a_pod_needing_a_hook_the_kernel_lacks_falls_back_and_says_which() {
    let refuse = (
        "CAPTURE_REFUSE_HOOKS",
        "cgroup/recvmsg4,cgroup/recvmsg6".to_string(),
    );
    let mut dns_pod = Topology::new();
    dns_pod.capture_env.push(refuse.clone());
    // Attached before the proxies start, as in a real pod.
    dns_pod.attach(&["--mode", "auto", "--redirect-dns", "--capture-all-dns"]);
    dns_pod.start_all();
    dns_pod.start_dns_proxy();
    let mut plain = Topology::with_dirs(dns_pod.dirs.shared());
    plain.capture_env.push(refuse);
    plain.attach(&["--mode", "auto"]);
    plain.start_all();

    let pods = dns_pod.status()["pods"].as_array().cloned().unwrap();
    let mode_of = |topo: &Topology| {
        let netns = topo.pod.netns.path().display().to_string();
        pods.iter()
            .find(|p| p["netns"] == netns.as_str())
            .unwrap_or_else(|| panic!("{netns} in {pods:?}"))
            .clone()
    };
    let dns_record = mode_of(&dns_pod);
    assert_eq!(dns_record["mode"], "iptables", "{dns_record}");
    let reason = dns_record["fallback_reason"].as_str().unwrap_or_default();
    assert!(reason.contains("cgroup/recvmsg4"), "{reason}");
    assert_eq!(dns_record["fallback_cause"], "kernel_hook", "{dns_record}");
    assert_eq!(mode_of(&plain)["mode"], "ebpf");
    assert_eq!(
        cgroup_programs(&plain.pod.cgroup.path).len(),
        POD_CGROUP_HOOKS
    );
    assert!(cgroup_programs(&dns_pod.pod.cgroup.path).is_empty());

    run_cases(
        &dns_pod,
        &[
            Case::new(
                "dns on iptables",
                Who::app(),
                "10.0.0.5:53",
                Dns("10.0.0.5:53"),
            )
            .opts(ConnectOpts {
                udp: true,
                ..ConnectOpts::default()
            }),
            Case::new(
                "tcp on iptables",
                Who::app(),
                "10.0.0.5:80",
                Outbound("10.0.0.5:80"),
            ),
        ],
    );
    run_cases(
        &plain,
        &[Case::new(
            "ebpf",
            Who::app(),
            "10.0.0.5:80",
            Outbound("10.0.0.5:80"),
        )],
    );
}

/// The probe behind `auto` and `capture doctor` loads every program and links it to a scratch
/// cgroup or netns; on every kernel of the matrix all of them must pass, and nothing stays.
#[test]
fn the_probe_loads_and_attaches_every_hook_and_leaves_nothing() {
    capture_tests::require_root();
    let probe =
        capture_user::probe::probe(&capture_user::iptables::flavour::NodeVariant::default());
    let programs: Vec<_> = probe
        .checks
        .iter()
        .filter(|c| c.name.starts_with("program "))
        .collect();
    assert_eq!(programs.len(), capture_user::ebpf::hooks::HOOKS.len());
    for check in &programs {
        assert!(check.ok, "{}: {}", check.name, check.detail);
        assert_eq!(
            check.detail, "loads, verifies and attaches",
            "{}",
            check.name
        );
    }
    assert!(probe.ebpf_usable, "{:?}", probe.checks);
    let left = scratch_cgroups_left("probe");
    assert!(left.is_empty(), "{left:?}");
}
