//! What the test tells containerd and, as kubelet, the CRI: containerd's configuration, and the
//! sandbox and container settings kubelet would send.

use std::path::{Path, PathBuf};

use serde_json::Value;

use k8s_cri::v1::{
    ContainerConfig, ContainerMetadata, Int64Value, LinuxContainerConfig,
    LinuxContainerSecurityContext, NamespaceMode, NamespaceOption,
};

use super::{cri, image};
use crate::cni::Node;

/// containerd 1.6's configuration: every directory under `dir`, the CRI plugin on the node's CNI
/// directories, runc with the cgroup driver kubelet uses.
pub fn containerd_config(dir: &Path, socket: &Path, node: &Node, systemd_cgroup: bool) -> String {
    let d = dir.display();
    format!(
        r#"version = 2
root = "{d}/root"
state = "{d}/state"
disabled_plugins = ["io.containerd.snapshotter.v1.btrfs", "io.containerd.snapshotter.v1.zfs", "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.aufs"]

[grpc]
  address = "{socket}"

[ttrpc]
  address = "{socket}.ttrpc"

[plugins."io.containerd.internal.v1.opt"]
  path = "{d}/opt"

[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{pause}"
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  # The pod sandbox's oom_score_adj is kept at containerd's own or above, as for a rootless
  # containerd: where the tests run in a container without CAP_SYS_RESOURCE, runc could not
  # lower it to kubelet's -998.
  restrict_oom_score_adj = true
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    default_runtime_name = "runc"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = {systemd_cgroup}
        Root = "{d}/runc"
        BinaryName = "{d}/bin/runc"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "{bin}"
    conf_dir = "{conf}"
    max_conf_num = 1
"#,
        socket = socket.display(),
        pause = image::PAUSE_IMAGE,
        bin = node.plugin_dir.display(),
        conf = node.conf_dir().display(),
    )
}

pub fn namespaces() -> NamespaceOption {
    NamespaceOption {
        network: NamespaceMode::Pod as i32,
        pid: NamespaceMode::Container as i32,
        ipc: NamespaceMode::Pod as i32,
        ..Default::default()
    }
}

/// A container as kubelet names it to the runtime: metadata, image, log file and the container
/// name label; the caller adds what it runs and how.
pub fn named_container(name: &str, image: &str) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_string(),
            attempt: 0,
        }),
        image: Some(cri::image_spec(image)),
        log_path: format!("{name}.log"),
        labels: [("io.kubernetes.container.name".to_string(), name.to_string())].into(),
        ..Default::default()
    }
}

pub fn container_config(name: &str, image: &str, user: i64) -> ContainerConfig {
    container_config_as(name, image, (user, user, &[]))
}

/// As [`container_config`], as uid, primary gid and supplementary groups `ids`.
pub fn container_config_as(name: &str, image: &str, ids: (i64, i64, &[i64])) -> ContainerConfig {
    let (uid, gid, groups) = ids;
    ContainerConfig {
        linux: Some(LinuxContainerConfig {
            security_context: Some(LinuxContainerSecurityContext {
                run_as_user: Some(Int64Value { value: uid }),
                run_as_group: Some(Int64Value { value: gid }),
                supplemental_groups: groups.to_vec(),
                namespace_options: Some(namespaces()),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..named_container(name, image)
    }
}

/// The slice kubelet's systemd driver gives pod `uid`.
pub fn pod_slice(uid: &str) -> String {
    format!("kubepods-besteffort-pod{}.slice", uid.replace('-', "_"))
}

/// Gives capture-cni a minute for the agent's answer in each conflist of `conf_dir` (as the CNI
/// tests' own conflist does): under emulation (the kernel matrix) an iptables attach's first
/// module loads alone take seconds, past the 10 s default.
pub fn allow_slow_attaches(conf_dir: &Path) {
    let Ok(entries) = std::fs::read_dir(conf_dir) else {
        return;
    };
    for file in entries.flatten().map(|e| e.path()) {
        let Ok(mut list) = std::fs::read_to_string(&file)
            .map_err(|_| ())
            .and_then(|t| serde_json::from_str::<Value>(&t).map_err(|_| ()))
        else {
            continue;
        };
        let Some(plugins) = list["plugins"].as_array_mut() else {
            continue;
        };
        for plugin in plugins.iter_mut().filter(|p| p["type"] == "capture-cni") {
            plugin["timeout_seconds"] = Value::from(60);
        }
        std::fs::write(&file, serde_json::to_string_pretty(&list).expect("JSON"))
            .expect("rewriting the conflist");
    }
}

/// Where `command` is on PATH (or the sbin directories root's PATH may lack).
pub fn setup_tools_path(command: &str) -> PathBuf {
    std::env::var("PATH")
        .unwrap_or_default()
        .split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"])
        .map(|dir| Path::new(dir).join(command))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("no {command} on PATH; `cargo xtask setup` installs it"))
}
