//! One captured pod on a little network: the pod netns (eth0 10.1.0.10/24, `fd00:1::10/64`) joined
//! by veth to a "remote" netns that owns every destination the tests dial (10.0.0.0/16,
//! 10.2.0.0/16, 10.96.0.0/16, 1.0.0.0/8, `fd00:2::/64`), plus the pod's cgroup and its own capture
//! directories.

use std::{
    path::PathBuf,
    process::{Command, Output},
};

use crate::{
    built_binary,
    guards::{ip, ip_batch, CaptureDirs, CgroupGuard, ChildGuard, NetnsGuard},
    probe::{probe_bin, ConnectOpts, Outcome, Who},
    require_root,
};

pub const POD_IP4: &str = "10.1.0.10";
pub const POD_IP6: &str = "fd00:1::10";
/// TCP ports the remote netns serves on every address it owns (v4 and v6).
pub const REMOTE_PORTS: [u16; 7] = [80, 5555, 8080, 9090, 15008, 15020, 32000];
/// UDP echo port on the remote side (at 10.0.0.5 and `fd00:2::5`).
pub const REMOTE_UDP_PORT: u16 = 5000;

/// The `capture` binary under test.
#[must_use]
pub fn capture_bin() -> PathBuf {
    built_binary("capture", "CAPTURE_BIN")
}

/// A pod: its netns and cgroup.
pub struct Pod {
    pub cgroup: CgroupGuard,
    pub netns: NetnsGuard,
}

pub struct Topology {
    // Field order is drop order: servers die before their cgroup and netns go.
    servers: Vec<ChildGuard>,
    pub pod: Pod,
    pub remote: NetnsGuard,
    /// A virtual machine behind the pod (KubeVirt style), once `add_vm` made one.
    pub vm: Option<NetnsGuard>,
    pub dirs: CaptureDirs,
    /// Environment for every `capture` run (e.g. `CAPTURE_REFUSE_HOOKS`).
    pub capture_env: Vec<(&'static str, String)>,
    /// The netns every `capture` run starts in (the node's, as the agent's would be): the test's
    /// own when `None`.
    pub node_netns: Option<PathBuf>,
    /// A command every `capture` run goes through, with its arguments (empty: none): a PID
    /// namespace of its own, say (`OWN_PID_NAMESPACE`), or fewer capabilities.
    pub capture_wrapper: Vec<String>,
    /// The pod's addresses (`POD_IP4`, `POD_IP6` unless numbered).
    pub ip4: String,
    pub ip6: String,
}

/// `capture_wrapper` for a `capture` in a PID namespace of its own, as an agent's container
/// without `hostPID` runs: the pod's processes are out of its reach.
pub const OWN_PID_NAMESPACE: [&str; 5] = ["unshare", "--pid", "--fork", "--kill-child", "--"];

/// The pod's address on the VM link, and the VM's.
pub const POD_VM_IP: &str = "10.3.0.1";
pub const VM_IP: &str = "10.3.0.2";

pub use crate::pinned_maps::{
    delete_pinned_map_entries, fill_cidr_lists, node_pin_dir, pinned_map_len, POD_MAPS,
};

impl Topology {
    /// A pod and its remote, wired up, nothing attached or running yet.
    pub fn new() -> Self {
        Self::with_dirs(CaptureDirs::new())
    }

    /// As `new`, sharing another topology's capture directories (several pods on one "node").
    pub fn with_dirs(dirs: CaptureDirs) -> Self {
        Self::numbered(dirs, 0)
    }

    /// As `with_dirs`, with the pod on subnet `n` (10.1.n.10, `fd00:1:n::10`; 0 is `POD_IP4` and
    /// `POD_IP6`), so that many pods of one node have addresses of their own.
    pub fn numbered(dirs: CaptureDirs, n: u8) -> Self {
        require_root();
        Self::around(dirs, n, NetnsGuard::new("capture-pod"))
    }

    /// A pod whose netns belongs to a user namespace of its own (`hostUsers: false`): its ids
    /// 0..65536 are `outer_base` onwards on the node, and its processes run inside it.
    pub fn with_pod_userns(outer_base: u32) -> Self {
        require_root();
        Self::around(
            CaptureDirs::new(),
            0,
            NetnsGuard::with_userns("capture-pod", outer_base),
        )
    }

    fn around(dirs: CaptureDirs, n: u8, netns: NetnsGuard) -> Self {
        let pod = Pod {
            cgroup: CgroupGuard::new("capture-pod"),
            netns,
        };
        let remote = NetnsGuard::new("capture-remote");
        let (p, r) = (pod.netns.name.as_str(), remote.name.as_str());
        let (ip4, ip6) = (format!("10.1.{n}.10"), format!("fd00:1:{n:x}::10"));
        let (gw4, gw6) = (format!("10.1.{n}.1"), format!("fd00:1:{n:x}::1"));
        ip_batch(
            p,
            &[
                format!("link add eth0 type veth peer name eth0 netns {r}"),
                format!("addr add {ip4}/24 dev eth0"),
                format!("addr add {ip6}/64 dev eth0 nodad"),
                "link set eth0 up".into(),
                format!("route add default via {gw4}"),
                format!("route add default via {gw6}"),
            ],
        );
        let mut remote_setup = vec![
            format!("addr add {gw4}/24 dev eth0"),
            format!("addr add {gw6}/64 dev eth0 nodad"),
            "link set eth0 up".into(),
        ];
        for prefix in [
            "10.0.0.0/16",
            "10.2.0.0/16",
            "10.96.0.0/16",
            "1.0.0.0/8",
            "fd00:2::/64",
        ] {
            remote_setup.push(format!("route add local {prefix} dev lo"));
        }
        ip_batch(r, &remote_setup);
        Self {
            servers: Vec::new(),
            pod,
            remote,
            vm: None,
            dirs,
            capture_env: Vec::new(),
            capture_wrapper: Vec::new(),
            node_netns: None,
            ip4,
            ip6,
        }
    }

    /// A VM netns behind the pod's eth1 (pod 10.3.0.1/24, VM 10.3.0.2/24, the pod routes for it),
    /// with a `vm` listener on port 80.
    pub fn add_vm(&mut self) {
        let vm = NetnsGuard::new("capture-vm");
        let (p, v, r) = (
            self.pod.netns.name.as_str(),
            vm.name.as_str(),
            self.remote.name.as_str(),
        );
        ip(&[
            "-n", p, "link", "add", "eth1", "type", "veth", "peer", "name", "eth0", "netns", v,
        ]);
        ip(&[
            "-n",
            p,
            "addr",
            "add",
            &format!("{POD_VM_IP}/24"),
            "dev",
            "eth1",
        ]);
        ip(&[
            "-n",
            v,
            "addr",
            "add",
            &format!("{VM_IP}/24"),
            "dev",
            "eth0",
        ]);
        ip(&["-n", p, "link", "set", "eth1", "up"]);
        ip(&["-n", v, "link", "set", "eth0", "up"]);
        ip(&["-n", v, "route", "add", "default", "via", POD_VM_IP]);
        ip(&["-n", r, "route", "add", "10.3.0.0/24", "via", &self.ip4]);
        crate::guards::run(Command::new("ip").args([
            "netns",
            "exec",
            p,
            "sysctl",
            "-qw",
            "net.ipv4.ip_forward=1",
        ]));
        let mut cmd = Command::new(probe_bin());
        cmd.arg("--netns")
            .arg(vm.path())
            .arg("serve")
            .arg("--tcp")
            .arg("vm=0.0.0.0:80");
        self.servers.push(ChildGuard::spawn_ready(&mut cmd));
        self.vm = Some(vm);
    }

    /// One connection from the VM.
    pub fn connect_from_vm(&self, to: &str) -> Outcome {
        crate::probe::connect_with(
            crate::probe::probe_in(&self.vm.as_ref().expect("add_vm first").path(), None, None),
            to,
        )
    }

    /// The pod's nat table as `save_tool` (`iptables-save`, `ip6tables-legacy-save`, ...) prints
    /// it from inside the pod's netns.
    #[must_use]
    pub fn nat_table(&self, save_tool: &str) -> String {
        crate::guards::saved_rules_with(&self.pod.netns.path(), save_tool, &["-t", "nat"])
    }

    /// Runs `capture` with this topology's directories.
    pub fn capture(&self, args: &[&str]) -> Output {
        let mut cmd = self.capture_command(args);
        cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
    }

    /// What the node's programs were adapted to, as `capture status` reports it from the node's
    /// record.
    #[must_use]
    pub fn node_features(&self) -> serde_json::Value {
        self.status()["node_features"].clone()
    }

    /// `capture` with this topology's directories, to spawn.
    #[must_use]
    pub fn capture_command(&self, args: &[&str]) -> Command {
        let program = match self.capture_wrapper.first() {
            Some(wrapper) => PathBuf::from(wrapper),
            None => capture_bin(),
        };
        let mut cmd = match &self.node_netns {
            Some(netns) => crate::guards::in_netns(netns, program),
            None => Command::new(program),
        };
        if !self.capture_wrapper.is_empty() {
            cmd.args(&self.capture_wrapper[1..]).arg(capture_bin());
        }
        cmd.arg("--bpffs")
            .arg(&self.dirs.bpffs)
            .arg("--state-dir")
            .arg(&self.dirs.state)
            .args(args)
            .envs(self.capture_env.iter().map(|(k, v)| (k, v)));
        cmd
    }

    /// `capture attach` for this pod (both pod IPs) plus `extra`, returning the raw output.
    pub fn try_attach(&self, extra: &[&str]) -> Output {
        let (ip4, ip6) = (self.ip4.clone(), self.ip6.clone());
        self.try_attach_with_ips(&[&ip4, &ip6], extra)
    }

    /// `capture attach` naming only `pod_ips` as the pod's addresses.
    pub fn try_attach_with_ips(&self, pod_ips: &[&str], extra: &[&str]) -> Output {
        self.try_attach_in(&self.pod.cgroup.path, pod_ips, extra)
    }

    /// `capture attach` of the pod as if its cgroup were `cgroup` (a v1 one, say).
    pub fn try_attach_in(
        &self,
        cgroup: &std::path::Path,
        pod_ips: &[&str],
        extra: &[&str],
    ) -> Output {
        let netns = self.pod.netns.path();
        let mut args = vec![
            "attach",
            "--netns",
            netns.to_str().unwrap(),
            "--cgroup",
            cgroup.to_str().unwrap(),
        ];
        for ip in pod_ips {
            args.extend(["--pod-ip", ip]);
        }
        args.extend(extra);
        self.capture(&args)
    }

    /// Attaches, panicking with capture's error if it fails.
    pub fn attach(&self, extra: &[&str]) {
        let out = self.try_attach(extra);
        assert!(
            out.status.success(),
            "capture attach failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    pub fn detach(&self) -> Output {
        self.capture(&["detach", "--netns", self.pod.netns.path().to_str().unwrap()])
    }

    /// `capture status --json` by the build `bin` (another build than this one's, say), over
    /// this topology's directories.
    pub fn status_by(&self, bin: &std::path::Path) -> serde_json::Value {
        let out = Command::new(bin)
            .arg("--bpffs")
            .arg(&self.dirs.bpffs)
            .arg("--state-dir")
            .arg(&self.dirs.state)
            .args(["status", "--json"])
            .output()
            .expect("capture status");
        assert!(out.status.success(), "{out:?}");
        serde_json::from_slice(&out.stdout).expect("status JSON")
    }

    /// `capture status --json`.
    pub fn status(&self) -> serde_json::Value {
        let out = self.capture(&["status", "--json"]);
        assert!(
            out.status.success(),
            "capture status failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice(&out.stdout).expect("status JSON")
    }

    /// The pod's proxy identity as `status --json` records it (null under the uid rules).
    pub fn proxy_identity(&self) -> serde_json::Value {
        self.status()["pods"][0]["config"]["proxy_identity"].clone()
    }

    /// A probe command that enters the pod (cgroup, netns, its user namespace) as `who`.
    pub fn probe_in_pod(&self, who: &Who) -> Command {
        self.probe_in_cgroup(&self.pod.cgroup.path, who)
    }

    /// As [`Self::probe_in_pod`], in `cgroup` (a container's, below the pod's).
    pub fn probe_in_cgroup(&self, cgroup: &std::path::Path, who: &Who) -> Command {
        let mut cmd = Command::new(probe_bin());
        cmd.arg("--cgroup")
            .arg(cgroup)
            .arg("--netns")
            .arg(self.pod.netns.path());
        if let Some(userns) = self.pod.netns.userns_path() {
            cmd.arg("--userns").arg(userns);
        }
        who.args(&mut cmd);
        cmd
    }

    fn serve(&mut self, mut cmd: Command, listeners: &[(&str, String)]) {
        cmd.arg("serve");
        for (name, addr) in listeners {
            cmd.arg("--tcp").arg(format!("{name}={addr}"));
        }
        self.servers.push(ChildGuard::spawn_ready(&mut cmd));
    }

    /// The remote side: a `remote` listener on every `REMOTE_PORTS` port (v4 and v6) and a UDP echo.
    pub fn start_remote(&mut self) {
        let mut cmd = Command::new(probe_bin());
        cmd.arg("--netns").arg(self.remote.path());
        let mut listeners = Vec::new();
        for port in REMOTE_PORTS {
            listeners.push(("remote", format!("0.0.0.0:{port}")));
            listeners.push(("remote", format!("[::]:{port}")));
        }
        // UDP echoes on fixed addresses: a wildcard socket would answer from another source,
        // which a connected client socket drops.
        cmd.arg("serve");
        for addr in [
            format!("10.0.0.5:{REMOTE_UDP_PORT}"),
            format!("[fd00:2::5]:{REMOTE_UDP_PORT}"),
            "10.0.0.5:53".into(),
            "10.96.0.10:53".into(),
            "[fd00:2::5]:53".into(),
        ] {
            cmd.arg("--udp").arg(format!("remote={addr}"));
        }
        for (name, addr) in &listeners {
            cmd.arg("--tcp").arg(format!("{name}={addr}"));
        }
        self.servers.push(ChildGuard::spawn_ready(&mut cmd));
    }

    /// The sidecar in the pod (uid/gid 1337): `outbound` on 15001 and `inbound` on 15006, v4 and v6.
    pub fn start_proxy(&mut self) {
        self.start_proxy_on(&[("outbound", 15001), ("inbound", 15006)]);
    }

    /// The sidecar with only some of its listeners.
    pub fn start_proxy_on(&mut self, listeners: &[(&str, u16)]) {
        let cmd = self.probe_in_pod(&Who::proxy());
        let l: Vec<_> = listeners
            .iter()
            .flat_map(|(n, p)| [(*n, format!("0.0.0.0:{p}")), (*n, format!("[::]:{p}"))])
            .collect();
        self.serve(cmd, &l);
    }

    /// A proxy of the pod's own (uid 1337, in its netns and cgroup) running `capture-probe serve`
    /// with `args`; it stops when the guard drops.
    #[must_use]
    pub fn spawn_proxy_serving(&self, args: &[&str]) -> ChildGuard {
        let mut cmd = self.probe_in_pod(&Who::proxy());
        cmd.arg("serve").args(args);
        ChildGuard::spawn_ready(&mut cmd)
    }

    /// One worker's listener of the sidecar (uid 1337) on `port`, v4 and v6, with `SO_REUSEPORT` as
    /// Envoy opens them, answering as `name`; it closes when the guard drops.
    #[must_use]
    pub fn spawn_reuseport_listener(&self, name: &str, port: u16) -> ChildGuard {
        let mut cmd = self.probe_in_pod(&Who::proxy());
        cmd.arg("serve").arg("--reuseport");
        for addr in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
            cmd.arg("--tcp").arg(format!("{name}={addr}"));
        }
        ChildGuard::spawn_ready(&mut cmd)
    }

    /// The sidecar as TPROXY mode runs it: uid 0, gid 1337, transparent listeners on 15001/15006.
    pub fn start_tproxy_proxy(&mut self) {
        let mut cmd = self.probe_in_pod(&Who::new(0, 1337));
        cmd.arg("serve").arg("--transparent");
        for (name, port) in [("outbound", 15001), ("inbound", 15006)] {
            for addr in [format!("0.0.0.0:{port}"), format!("[::]:{port}")] {
                cmd.arg("--tcp").arg(format!("{name}={addr}"));
            }
        }
        self.servers.push(ChildGuard::spawn_ready(&mut cmd));
    }

    /// The proxy's DNS listener (istio-agent, uid 1337) on 127.0.0.1:15053 and [`::1`]:15053, UDP and TCP.
    pub fn start_dns_proxy(&mut self) {
        let mut cmd = self.probe_in_pod(&Who::proxy());
        cmd.arg("serve");
        for addr in ["127.0.0.1:15053", "[::1]:15053"] {
            cmd.arg("--udp")
                .arg(format!("dns={addr}"))
                .arg("--tcp")
                .arg(format!("dns={addr}"));
        }
        self.servers.push(ChildGuard::spawn_ready(&mut cmd));
    }

    /// The application in the pod (uid/gid 1000): `app` on 8080, 9090, the tunnel port and the
    /// proxy's own service ports (15008, 15020, 15021, 15090), v4 and v6.
    pub fn start_app(&mut self) {
        let cmd = self.probe_in_pod(&Who::app());
        let l: Vec<_> = [8080, 9090, 15008, 15020, 15021, 15090]
            .iter()
            .flat_map(|p| {
                [
                    ("app", format!("0.0.0.0:{p}")),
                    ("app", format!("[::]:{p}")),
                ]
            })
            .collect();
        self.serve(cmd, &l);
    }

    /// Remote, proxy and app all running.
    pub fn start_all(&mut self) {
        self.start_remote();
        self.start_proxy();
        self.start_app();
    }

    /// One connection from inside the pod.
    pub fn connect(&self, who: &Who, to: &str, opts: &ConnectOpts) -> Outcome {
        crate::probe::connect_opts(self.probe_in_pod(who), to, opts)
    }

    /// Runs a program inside the pod (cgroup, netns, identity) and returns its output.
    pub fn run_in_pod(&self, who: &Who, argv: &[&str]) -> Output {
        let mut cmd = self.probe_in_pod(who);
        cmd.arg("exec").arg("--").args(argv);
        cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
    }

    /// One connection from the remote netns (a client outside the pod).
    pub fn connect_from_remote(&self, to: &str) -> Outcome {
        crate::probe::connect_with(crate::probe::probe_in(&self.remote.path(), None, None), to)
    }

    /// A TCP connection with default options.
    pub fn tcp(&self, who: &Who, to: &str) -> Outcome {
        self.connect(who, to, &ConnectOpts::default())
    }

    /// A connection of `who` to `to` held open (`capture-probe hold`): release it with a line
    /// to get what it saw first and what it sees then.
    #[must_use]
    pub fn spawn_holder(&self, who: &Who, to: &str, udp: bool) -> ChildGuard {
        let mut cmd = self.probe_in_pod(who);
        cmd.arg("hold").arg(to);
        if udp {
            cmd.arg("--udp");
        }
        ChildGuard::spawn_ready(&mut cmd)
    }

    /// Starts a probe in the pod netns but outside its cgroup, waiting for a line on stdin
    /// before it connects.
    pub fn spawn_waiting_client(&self, who: &Who, to: &str) -> ChildGuard {
        let mut cmd = Command::new(probe_bin());
        cmd.arg("--netns").arg(self.pod.netns.path());
        who.args(&mut cmd);
        cmd.arg("connect").arg("--to").arg(to).arg("--wait-stdin");
        ChildGuard::spawn_ready(&mut cmd)
    }
}

impl Default for Topology {
    fn default() -> Self {
        Self::new()
    }
}

/// The programs capture attaches to the cgroup of a pod without DNS capture: `sock_create`,
/// `sock_ops`, getsockopt, getpeername4/6, getsockname4/6, connect4/6.
pub const POD_CGROUP_HOOKS: usize = 9;

/// The names of the programs attached to a cgroup (as the kernel keeps them: 15 bytes at most),
/// empty when none.
#[must_use]
pub fn cgroup_programs(cgroup: &std::path::Path) -> Vec<String> {
    use capture_user::ebpf::{
        hooks::{Target, HOOKS},
        sys,
    };
    use std::os::fd::AsFd as _;
    let dir = std::fs::File::open(cgroup)
        .unwrap_or_else(|e| panic!("opening cgroup {}: {e}", cgroup.display()));
    let mut attach_types: Vec<u32> = HOOKS
        .iter()
        .filter(|h| h.target == Target::Cgroup)
        .map(|h| h.attach_type)
        .collect();
    attach_types.dedup();
    attach_types
        .into_iter()
        .flat_map(|t| {
            sys::prog_query(dir.as_fd(), t)
                .unwrap_or_else(|e| panic!("querying {} (type {t}): {e}", cgroup.display()))
        })
        .map(|id| sys::prog_name(id).unwrap_or_else(|e| panic!("program {id}: {e}")))
        .collect()
}

/// Whether any pod's link pins are left under a node's bpffs directory.
#[must_use]
pub fn pod_pins_left(bpffs: &std::path::Path) -> bool {
    bpffs
        .join("pods")
        .read_dir()
        .expect("the node's pods pin directory")
        .any(|_| true)
}

/// The link pin directory of the node's only captured pod.
#[must_use]
pub fn only_pod_links(bpffs: &std::path::Path) -> PathBuf {
    let mut dirs: Vec<_> = bpffs
        .join("pods")
        .read_dir()
        .expect("the node's pods pin directory")
        .flatten()
        .map(|e| e.path())
        .collect();
    assert_eq!(dirs.len(), 1, "one pod's link pins: {dirs:?}");
    dirs.remove(0)
}
