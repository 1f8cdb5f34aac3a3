//! Running one plugin of the list as a runtime does: its configuration on stdin, the `CNI_*`
//! environment, from the node's netns; its result or its error as JSON.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

use serde_json::{json, Value};

use super::{Node, Pod, REFERENCE_PLUGINS};

impl Node {
    fn find_plugin(&self, ty: &str) -> PathBuf {
        [Path::new(REFERENCE_PLUGINS), &self.plugin_dir]
            .iter()
            .map(|d| d.join(ty))
            .find(|p| p.exists())
            .unwrap_or_else(|| {
                panic!("CNI plugin {ty} not found (is containernetworking-plugins installed?)")
            })
    }

    /// Runs one plugin as a runtime does: config on stdin, the CNI_* environment, in the node netns.
    pub fn exec_plugin(
        &self,
        command: &str,
        pod: &Pod,
        conf: &Value,
        cni_args: Option<&str>,
    ) -> Result<Value, Value> {
        let ty = conf["type"].as_str().expect("plugin type");
        self.exec_raw(command, pod, ty, &conf.to_string(), cni_args)
    }

    /// Runs plugin `ty` with `stdin` as its configuration, whatever that is.
    pub fn exec_raw(
        &self,
        command: &str,
        pod: &Pod,
        ty: &str,
        stdin: &str,
        cni_args: Option<&str>,
    ) -> Result<Value, Value> {
        let cmd = crate::guards::in_netns(&self.netns.path(), self.find_plugin(ty));
        self.exec_command(cmd, command, pod, stdin, cni_args)
    }

    /// `exec_plugin` from a thread already in the node's netns (`enter_netns`): the plugin is
    /// spawned as a runtime spawns it (`posix_spawn`), not from a fork of the caller that enters
    /// the netns, whose cost would be the caller's.
    pub fn exec_plugin_from_node_netns(
        &self,
        command: &str,
        pod: &Pod,
        conf: &Value,
        cni_args: Option<&str>,
    ) -> Result<Value, Value> {
        let ty = conf["type"].as_str().expect("plugin type");
        let cmd = Command::new(self.find_plugin(ty));
        self.exec_command(cmd, command, pod, &conf.to_string(), cni_args)
    }

    /// Moves the calling thread into the node's netns, for `exec_plugin_from_node_netns`.
    pub fn enter_netns(&self) {
        use std::os::fd::AsFd as _;
        let ns = std::fs::File::open(self.netns.path()).expect("the node's netns");
        nix::sched::setns(ns.as_fd(), nix::sched::CloneFlags::CLONE_NEWNET)
            .expect("entering the node's netns");
    }

    fn exec_command(
        &self,
        mut cmd: Command,
        command: &str,
        pod: &Pod,
        stdin: &str,
        cni_args: Option<&str>,
    ) -> Result<Value, Value> {
        let default_args = pod.cni_args();
        cmd.env("CNI_COMMAND", command)
            .env("CNI_CONTAINERID", &pod.container_id)
            .env("CNI_NETNS", pod.netns.path())
            .env("CNI_IFNAME", "eth0")
            .env("CNI_ARGS", cni_args.unwrap_or(&default_args))
            .env(
                "CNI_PATH",
                format!("{REFERENCE_PLUGINS}:{}", self.plugin_dir.display()),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = cmd.spawn().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        child
            .stdin
            .take()
            .unwrap()
            .write_all(stdin.as_bytes())
            .unwrap();
        let out = child.wait_with_output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        let parsed = if stdout.trim().is_empty() {
            Value::Null
        } else {
            serde_json::from_str(&stdout).unwrap_or(json!({"raw": stdout}))
        };
        if out.status.success() {
            Ok(parsed)
        } else {
            Err(json!({"error": parsed, "stderr": String::from_utf8_lossy(&out.stderr)}))
        }
    }
}
