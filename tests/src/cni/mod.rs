//! A small container runtime for the CNI end-to-end tests: it runs a real conflist (the Debian
//! reference plugins `bridge` + `host-local`, then `capture-cni`) the way containerd does, in a
//! "node" netns of its own so the bridge never touches the host, against pods made of a netns
//! and a kubelet-style pod cgroup. It also runs the capture agent.

use std::{
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::Duration,
};

use serde_json::{json, Value};

use crate::{
    built_binary,
    guards::{CaptureDirs, ChildGuard, NetnsGuard},
    probe::probe_in,
    unique,
};

pub const POD_SUBNET: &str = "10.88.0.0/24";
/// The pod subnet of an IPv6-only node (`Node::ipv6_only`).
pub const POD_SUBNET6: &str = "fd00:88::/64";

/// The annotation the sidecar injector leaves on a pod with a proxy: what makes capture-cni act.
pub const MESHED: &[(&str, &str)] = &[(
    "sidecar.istio.io/status",
    "{\"containers\":[\"istio-proxy\"]}",
)];

const REFERENCE_PLUGINS: &str = "/usr/lib/cni";
pub use crate::agent::{Agent, HttpResponse, METRICS_CONTENT_TYPE};
pub use pod::{pod_status, Pod};

mod exec;
mod pod;

/// The CNI error code of a failed plugin run (its error object as `exec_plugin` returns it).
#[must_use]
pub fn error_code(err: &Value) -> Option<u64> {
    err["error"]["code"].as_u64()
}

/// kubelet's two pod cgroup layouts.
#[derive(Clone, Copy, Debug)]
pub enum CgroupDriver {
    Cgroupfs,
    Systemd,
}

/// A test node: its netns (where plugins run and the bridge lives), a kubepods cgroup tree, the
/// capture directories, and the plugin directory with capture-cni in it.
pub struct Node {
    pub netns: NetnsGuard,
    pub cgroup_root: PathBuf,
    pub dirs: CaptureDirs,
    pub socket: PathBuf,
    pub plugin_dir: PathBuf,
    pub ipam_dir: PathBuf,
    pub http: u16,
    /// The conflist as `capture install-cni` left it, once a test has run it.
    installed: std::sync::Mutex<Option<Value>>,
}

impl Node {
    pub fn new() -> Self {
        Self::under(&capture_user::cgroup::cgroup2_mount().expect("cgroup2"))
    }

    /// A node whose kubepods tree is below `mount` (a cgroup v1 hierarchy's, for a node booted
    /// without cgroup v2).
    pub fn under(mount: &Path) -> Self {
        crate::require_root();
        let netns = NetnsGuard::new("capture-node");
        let cgroup_root = mount.join(unique("capture-kubepods"));
        std::fs::create_dir(&cgroup_root).expect("cgroup root");
        let dirs = CaptureDirs::new();
        let scratch = std::env::temp_dir().join(unique("capture-cni"));
        let plugin_dir = scratch.join("bin");
        std::fs::create_dir_all(&plugin_dir).unwrap();
        std::os::unix::fs::symlink(
            built_binary("capture-cni", "CAPTURE_CNI_BIN"),
            plugin_dir.join("capture-cni"),
        )
        .unwrap();
        let free = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let http = free.local_addr().unwrap().port();
        drop(free);
        Self {
            netns,
            socket: dirs.state.join("agent.sock"),
            cgroup_root,
            dirs,
            plugin_dir,
            ipam_dir: scratch.join("ipam"),
            http,
            installed: std::sync::Mutex::new(None),
        }
    }

    /// The network plugin's own configuration (bridge and host-local), before anything chains
    /// into it; its path.
    pub fn write_network_conflist(&self) -> PathBuf {
        let conf_dir = self.conf_dir();
        std::fs::create_dir_all(&conf_dir).unwrap();
        let mut base = self.conflist();
        base["plugins"].as_array_mut().unwrap().truncate(1);
        let file = conf_dir.join("10-bridge.conflist");
        std::fs::write(&file, serde_json::to_string_pretty(&base).unwrap()).unwrap();
        file
    }

    /// The conflist the runtime uses: the one `install_cni` produced, or an equivalent one that
    /// also points capture-cni at this node's own cgroup tree.
    #[must_use]
    pub fn conflist(&self) -> Value {
        if let Some(v) = self.installed.lock().unwrap().clone() {
            return v;
        }
        json!({
            "cniVersion": "1.0.0",
            "name": "capture-test",
            "plugins": [
                {
                    "type": "bridge",
                    "bridge": "cni0",
                    "isGateway": true,
                    "ipMasq": false,
                    "ipam": {"type": "host-local", "ranges": [[{"subnet": POD_SUBNET}]], "dataDir": self.ipam_dir},
                },
                {
                    "type": "capture-cni",
                    "agent_socket": self.socket,
                    "state_dir": self.dirs.state,
                    "cgroup_root": self.cgroup_root,
                    // Generous: the kernel matrix runs this under emulation, where an iptables
                    // fallback's first module loads alone can take 10 s.
                    "timeout_seconds": 60,
                    "capabilities": {"io.kubernetes.cri.pod-annotations": true},
                },
            ],
        })
    }

    /// Makes this node's pod network IPv6-only: its pods get an address from `POD_SUBNET6`
    /// and none of IPv4.
    pub fn ipv6_only(&self) {
        let mut list = self.conflist();
        list["plugins"][0]["ipam"]["ranges"] = json!([[{"subnet": POD_SUBNET6}]]);
        *self.installed.lock().unwrap() = Some(list);
    }

    /// Uses `list` as this node's chained configuration from now on (a network plugin's own
    /// settings, a subnet of another size).
    pub fn use_conflist(&self, list: Value) {
        *self.installed.lock().unwrap() = Some(list);
    }

    /// Makes this node's pod network dual-stack: its pods get an address from `POD_SUBNET` and
    /// one from `POD_SUBNET6`.
    pub fn dual_stack(&self) {
        let mut list = self.conflist();
        list["plugins"][0]["ipam"]["ranges"] =
            json!([[{"subnet": POD_SUBNET}], [{"subnet": POD_SUBNET6}]]);
        *self.installed.lock().unwrap() = Some(list);
    }

    /// Writes the network plugin's own conflist (bridge + host-local) into a conf dir, runs
    /// `capture install-cni` on it as the DaemonSet does, and uses the result from then on.
    pub fn install_cni(&self) -> Value {
        self.write_network_conflist();
        self.run_install_cni(&[])
            .unwrap_or_else(|e| panic!("install-cni: {e}"))
    }

    /// `capture install-cni` with `extra` arguments on the configuration directory as it is:
    /// the conflist it left, or its stderr.
    pub fn run_install_cni(&self, extra: &[&str]) -> Result<Value, String> {
        let conf_dir = self.conf_dir();
        let file = conf_dir.join("10-bridge.conflist");
        let out = Command::new(crate::topology::capture_bin())
            .arg("--state-dir")
            .arg(&self.dirs.state)
            .arg("install-cni")
            .arg("--cni-bin-dir")
            .arg(&self.plugin_dir)
            .arg("--cni-conf-dir")
            .arg(&conf_dir)
            .arg("--plugin-binary")
            .arg(built_binary("capture-cni", "CAPTURE_CNI_BIN"))
            .args(extra)
            .output()
            .unwrap();
        if !out.status.success() {
            return Err(String::from_utf8_lossy(&out.stderr).into_owned());
        }
        let installed: Value =
            serde_json::from_str(&std::fs::read_to_string(&file).unwrap()).unwrap();
        *self.installed.lock().unwrap() = Some(installed.clone());
        Ok(installed)
    }

    /// `capture uninstall-cni` on this node's CNI directories; its stderr when it fails.
    pub fn uninstall_cni(&self) -> Result<(), String> {
        let out = Command::new(crate::topology::capture_bin())
            .arg("uninstall-cni")
            .arg("--cni-bin-dir")
            .arg(&self.plugin_dir)
            .arg("--cni-conf-dir")
            .arg(self.conf_dir())
            .output()
            .unwrap();
        if out.status.success() {
            Ok(())
        } else {
            Err(String::from_utf8_lossy(&out.stderr).into_owned())
        }
    }

    /// A file of the test's own, under the node's scratch directory (removed with the node); its
    /// directory is created.
    #[must_use]
    pub fn scratch_file(&self, relative: &str) -> PathBuf {
        let path = self.plugin_dir.parent().unwrap().join(relative);
        std::fs::create_dir_all(path.parent().unwrap()).unwrap();
        path
    }

    /// The node's CNI configuration directory (what stands for /etc/cni/net.d).
    #[must_use]
    pub fn conf_dir(&self) -> PathBuf {
        self.plugin_dir.parent().unwrap().join("net.d")
    }

    /// Overrides the conflist the runtime uses.
    pub fn installed_conflist(&self) -> std::sync::MutexGuard<'_, Option<Value>> {
        self.installed.lock().unwrap()
    }

    /// Starts the agent and waits until /readyz says so.
    pub fn start_agent(&self, mode: &str) -> Agent {
        self.start_agent_with(mode, &[])
    }

    /// Starts the agent with `extra` arguments and waits until /readyz says so.
    pub fn start_agent_with(&self, mode: &str, extra: &[&str]) -> Agent {
        let agent = self.spawn_agent_of(&crate::topology::capture_bin(), mode, extra);
        agent.wait_ready();
        agent
    }

    /// Starts the agent of the `capture` binary `bin` (another build) and returns at once.
    pub fn spawn_agent_of(&self, bin: &Path, mode: &str, extra: &[&str]) -> Agent {
        self.spawn_agent_as(Command::new(bin), mode, extra)
    }

    /// Starts the agent with `cmd` (`capture`, or a command that runs it, such as nsenter into
    /// another mount namespace) and waits until /readyz says so.
    pub fn start_agent_as(&self, cmd: Command, mode: &str) -> Agent {
        let agent = self.spawn_agent_as(cmd, mode, &[]);
        agent.wait_ready();
        agent
    }

    /// Starts the agent with `cmd` (as `start_agent_as`) and returns at once.
    pub fn spawn_agent_as(&self, mut cmd: Command, mode: &str, extra: &[&str]) -> Agent {
        cmd.arg("--bpffs")
            .arg(&self.dirs.bpffs)
            .arg("--state-dir")
            .arg(&self.dirs.state);
        cmd.args([
            "agent",
            "--mode",
            mode,
            "--http",
            &format!("127.0.0.1:{}", self.http),
        ]);
        cmd.args(extra);
        // The host's runtime is none of a test's business: only the tests of the reconcile,
        // which name their runtime and period, turn it on. An environment variable, which the
        // previous release's agent (the upgrade tests') ignores, where a flag would stop it.
        cmd.env("CAPTURE_RECONCILE_PERIOD", "0");
        cmd.arg("--socket")
            .arg(&self.socket)
            .stdout(Stdio::null())
            .stderr(Stdio::inherit());
        let child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        Agent {
            child: Some(child),
            http: self.http,
        }
    }

    /// A new pod: netns and kubelet-style cgroup, not yet on the network.
    pub fn pod(&self, name: &str, driver: CgroupDriver, annotations: &[(&str, &str)]) -> Pod {
        let uid = pod_uid();
        let cgroup = self.pod_cgroup(driver, &uid);
        std::fs::create_dir_all(&cgroup).expect("pod cgroup");
        Pod {
            name: name.into(),
            namespace: "default".into(),
            uid,
            container_id: unique("sandbox").replace('-', ""),
            netns: NetnsGuard::new("capture-cnipod"),
            cgroup,
            annotations: annotations
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            ip: None,
            result: None,
        }
    }

    /// The cgroup kubelet gives pod `uid` under this node's kubepods tree with `driver`.
    #[must_use]
    pub fn pod_cgroup(&self, driver: CgroupDriver, uid: &str) -> PathBuf {
        pod_cgroup_under(&self.cgroup_root, driver, uid)
    }

    /// The config a runtime hands one plugin of the list.
    #[must_use]
    pub fn plugin_conf(
        &self,
        list: &Value,
        index: usize,
        pod: &Pod,
        prev: Option<&Value>,
    ) -> Value {
        let mut conf = list["plugins"][index].clone();
        conf["cniVersion"] = list["cniVersion"].clone();
        conf["name"] = list["name"].clone();
        if let Some(p) = prev {
            conf["prevResult"] = p.clone();
        }
        if conf["capabilities"]["io.kubernetes.cri.pod-annotations"] == json!(true) {
            // As containerd passes them: a pod without annotations has a nil map, `null`.
            let annotations = if pod.annotations.is_empty() {
                Value::Null
            } else {
                json!(pod.annotations)
            };
            conf["runtimeConfig"] = json!({"io.kubernetes.cri.pod-annotations": annotations});
        }
        conf
    }

    /// CNI ADD through the whole list; on success the pod knows its IP. A failed ADD is cleaned
    /// up with a DEL through the list, as runtimes do before they retry.
    pub fn add(&self, pod: &mut Pod) -> Result<Value, Value> {
        let list = self.conflist();
        let mut prev: Option<Value> = None;
        for i in 0..list["plugins"].as_array().unwrap().len() {
            let conf = self.plugin_conf(&list, i, pod, prev.as_ref());
            match self.exec_plugin("ADD", pod, &conf, None) {
                Ok(result) => prev = Some(result),
                Err(e) => {
                    let _ = self.del(pod);
                    return Err(e);
                }
            }
        }
        let result = prev.expect("a result");
        assert!(result["ips"][0]["address"].is_string(), "an IP: {result}");
        pod.set_result(result.clone());
        Ok(result)
    }

    /// The network plugin's ADD alone (the list's first plugin), its result kept as the
    /// prevResult of what follows: a pod ready for capture-cni's ADD, as a benchmark times it.
    pub fn add_network(&self, pod: &mut Pod) -> Result<(), Value> {
        let conf = self.plugin_conf(&self.conflist(), 0, pod, None);
        pod.set_result(self.exec_plugin("ADD", pod, &conf, None)?);
        Ok(())
    }

    /// CNI DEL through the list in reverse, with the cached result as prevResult. Every plugin
    /// runs; the first error is returned.
    pub fn del(&self, pod: &Pod) -> Result<(), Value> {
        let list = self.conflist();
        let mut first_error = Ok(());
        for i in (0..list["plugins"].as_array().unwrap().len()).rev() {
            let conf = self.plugin_conf(&list, i, pod, pod.result.as_ref());
            if let Err(e) = self.exec_plugin("DEL", pod, &conf, None) {
                first_error = first_error.and(Err(e));
            }
        }
        first_error
    }

    /// CNI CHECK of capture-cni alone (the reference plugins' CHECK is theirs to test).
    pub fn check(&self, pod: &Pod) -> Result<Value, Value> {
        let list = self.conflist();
        let conf = self.plugin_conf(&list, 1, pod, pod.result.as_ref());
        self.exec_plugin("CHECK", pod, &conf, None)
    }

    /// capture-cni with a 1.1.0 config (STATUS and GC are 1.1.0 operations).
    pub fn capture_cni_v11(&self, command: &str, pod: &Pod, extra: Value) -> Result<Value, Value> {
        let list = self.conflist();
        let mut conf = self.plugin_conf(&list, 1, pod, None);
        conf["cniVersion"] = json!("1.1.0");
        if let (Some(c), Some(e)) = (conf.as_object_mut(), extra.as_object()) {
            c.extend(e.clone());
        }
        self.exec_plugin(command, pod, &conf, None)
    }

    /// `capture ARGS` over the node's directories.
    #[must_use]
    pub fn capture(&self, args: &[&str]) -> std::process::Output {
        Command::new(crate::topology::capture_bin())
            .arg("--bpffs")
            .arg(&self.dirs.bpffs)
            .arg("--state-dir")
            .arg(&self.dirs.state)
            .args(args)
            .output()
            .expect("capture")
    }

    /// `capture status --json` over the node's directories.
    #[must_use]
    pub fn status(&self) -> Value {
        let out = self.capture(&["status", "--json"]);
        assert!(out.status.success(), "capture status: {out:?}");
        serde_json::from_slice(&out.stdout).expect("status JSON")
    }

    /// Where a pod's connection lands if it bypasses capture: a listener on port 80 of the node
    /// netns, which the pods reach at their gateway, answering as `remote`.
    #[must_use]
    pub fn start_remote(&self) -> ChildGuard {
        ChildGuard::spawn_ready(probe_in(&self.netns.path(), None, None).args([
            "serve",
            "--tcp",
            "remote=0.0.0.0:80",
        ]))
    }

    /// A client in the node netns (like the kubelet or another node's pod).
    #[must_use]
    pub fn client(&self) -> Command {
        probe_in(&self.netns.path(), None, None)
    }
}

/// The cgroup kubelet gives pod `uid` with `driver`, under `root` (what stands for the top of
/// kubelet's tree).
#[must_use]
pub fn pod_cgroup_under(root: &Path, driver: CgroupDriver, uid: &str) -> PathBuf {
    match driver {
        CgroupDriver::Cgroupfs => root.join("kubepods/burstable").join(format!("pod{uid}")),
        CgroupDriver::Systemd => {
            root.join("kubepods.slice/kubepods-besteffort.slice")
                .join(format!(
                    "kubepods-besteffort-pod{}.slice",
                    uid.replace('-', "_")
                ))
        }
    }
}

/// A fresh pod UID in the UUID form the API server gives.
#[must_use]
pub fn pod_uid() -> String {
    format!(
        "{:08x}-1111-2222-3333-{:012x}",
        std::process::id(),
        rand_suffix()
    )
}

impl Default for Node {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        remove_cgroup_tree(&self.cgroup_root);
        let _ = std::fs::remove_dir_all(self.plugin_dir.parent().unwrap());
    }
}

pub use crate::guards::directory_tree;

/// Removes a cgroup directory tree, deepest first, killing what is left in it.
pub fn remove_cgroup_tree(root: &Path) {
    for d in directory_tree(root).iter().rev() {
        let _ = std::fs::write(d.join("cgroup.kill"), "1");
        let _ = crate::wait::poll_until(Duration::from_secs(5), || {
            if std::fs::remove_dir(d).is_ok() || !d.exists() {
                Ok(())
            } else {
                Err(())
            }
        });
    }
}

fn rand_suffix() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static N: AtomicU64 = AtomicU64::new(1);
    N.fetch_add(1, Ordering::Relaxed)
}
