//! A node whose cgroups systemd manages, for kubelet's and runc's systemd cgroup driver on
//! machines whose PID 1 is not systemd: Debian's systemd runs as PID 1 of a PID, mount and cgroup
//! namespace of its own (as in a system container), with a private /run and cgroup v2 mounted at
//! /sys/fs/cgroup, where the cgroup the test gives it is the root: runc takes the systemd
//! driver's slices to start at the top of the cgroup mount. It starts nothing but an empty
//! target. containerd, runc and the capture agent run in its mount and PID
//! namespaces, so that they see its /run and cgroup mount as on a node, the /proc mounted there
//! is theirs, and the PIDs runc hands systemd are systemd's. Killing it ends every process inside.

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

/// Where systemd mounts cgroup v2 inside, as on a node.
pub const INNER_CGROUP_MOUNT: &str = "/sys/fs/cgroup";

/// The systemd binary Debian's package installs.
pub const SYSTEMD: &str = "/lib/systemd/systemd";

/// The script that becomes systemd: it runs as PID 1 of the new namespaces, whose cgroup
/// namespace starts at the cgroup it was started in.
const BOOT: &str = r"set -e
mount -t tmpfs -o mode=755 run /run
mkdir -p /run/lock /run/systemd/system
# Whatever the host has there (a hybrid layout's tmpfs with v1 hierarchies and the unified one
# below it, or cgroup2 itself) gives way to cgroup v2 alone, as on a node systemd runs in unified
# mode; nothing may stay mounted below it, shadowed but still listed in /proc/self/mounts.
umount -R /sys/fs/cgroup
mount -t cgroup2 cgroup2 /sys/fs/cgroup
printf '[Unit]\nDescription=capture test node\nDefaultDependencies=no\n' \
    > /run/systemd/system/capture-node.target
export container=capture-test
exec /lib/systemd/systemd --unit=capture-node.target --log-target=null
";

pub struct SystemdNode {
    child: Child,
    /// PID 1 of the namespaces, as the host sees it.
    pub pid: u32,
    /// The cgroup systemd manages, as the host sees it (cgroup v2); inside, the top of the
    /// cgroup mount.
    pub host_root: PathBuf,
}

impl SystemdNode {
    /// Boots systemd on `host_root` (a cgroup v2 directory that exists and is empty), and waits
    /// until it is running.
    #[must_use]
    pub fn boot(host_root: &Path) -> Self {
        delegate_controllers(host_root);
        // Into the root cgroup first: the cgroup namespace starts where unshare is.
        let enter_root = format!(
            "echo $$ > {} && exec \"$@\"",
            host_root.join("cgroup.procs").display()
        );
        let child = Command::new("bash")
            .args(["-c", &enter_root, "enter"])
            .arg("unshare")
            .args(["--pid", "--mount", "--cgroup", "--fork", "--mount-proc"])
            .args(["--propagation", "private", "bash", "-c", BOOT])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("unshare (util-linux) running systemd");
        let mut node = Self {
            child,
            pid: 0,
            host_root: host_root.to_path_buf(),
        };
        let deadline = Instant::now() + Duration::from_mins(2);
        loop {
            if node.pid == 0 {
                node.pid = pid_of_systemd_in(host_root).unwrap_or(0);
                if node.pid != 0 {
                    // unshare itself stays behind in the root cgroup, waiting for systemd; a
                    // cgroup with a process may not enable controllers for its children, so it
                    // goes back where the test runs.
                    leave_for_own_cgroup(node.child.id());
                }
            }
            if node.pid != 0 {
                let state = node.systemctl(&["is-system-running"]);
                if matches!(state.trim(), "running" | "degraded") {
                    return node;
                }
            }
            if let Ok(Some(status)) = node.child.try_wait() {
                panic!("systemd exited ({status}) before it was running");
            }
            assert!(Instant::now() < deadline, "systemd did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// A command that runs `program` in the node's mount and cgroup namespaces (and, with `pid`,
    /// its PID namespace as well).
    #[must_use]
    pub fn command(&self, pid: bool, program: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.arg("-t")
            .arg(self.pid.to_string())
            .args(["--mount", "--cgroup"]);
        if pid {
            cmd.arg("--pid");
        }
        cmd.arg("--").arg(program);
        cmd
    }

    /// `systemctl args` inside; its stdout (whatever it exits with).
    pub fn systemctl(&self, args: &[&str]) -> String {
        let out = self
            .command(true, "systemctl")
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("running systemctl inside");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// What kubelet's systemd driver does for a pod before RunPodSandbox: the pod's slice, with
    /// the resource settings kubelet gives a best-effort pod (cpu weight 1 for its 2 CPU shares,
    /// memory and task accounting), which make systemd enable those controllers down to it.
    /// kubelet makes it a transient unit; here it is a unit file in the node's /run. Returns the
    /// slice's name and its cgroup as the host sees it.
    pub fn start_pod_slice(&self, uid: &str) -> (String, PathBuf) {
        let name = super::config::pod_slice(uid);
        let unit = format!("/run/systemd/system/{name}");
        let status = self
            .command(true, "sh")
            .arg("-c")
            .arg(format!(
                "printf '[Unit]\\nDescription=pod {uid}\\n[Slice]\\nCPUWeight=1\\nMemoryAccounting=yes\\nTasksAccounting=yes\\n' > {unit} && systemctl daemon-reload && systemctl start {name}"
            ))
            .stdin(Stdio::null())
            .status()
            .expect("starting the pod slice");
        assert!(status.success(), "starting {name}");
        let cgroup = self
            .host_root
            .join("kubepods.slice/kubepods-besteffort.slice")
            .join(&name);
        assert!(cgroup.is_dir(), "systemd made no {}", cgroup.display());
        (name, cgroup)
    }

    /// kubelet's cleanup after RemovePodSandbox: the pod slice stopped and its unit removed.
    pub fn stop_pod_slice(&self, name: &str) {
        let _ = self
            .command(true, "sh")
            .arg("-c")
            .arg(format!(
                "systemctl stop {name}; rm -f /run/systemd/system/{name}; systemctl daemon-reload"
            ))
            .stdin(Stdio::null())
            .status();
    }

    /// A cgroup path as the processes inside see it, made a host path.
    #[must_use]
    pub fn host_path(&self, inner: &Path) -> PathBuf {
        match inner.strip_prefix(INNER_CGROUP_MOUNT) {
            Ok(rel) => self.host_root.join(rel),
            Err(_) => inner.to_path_buf(),
        }
    }
}

impl Drop for SystemdNode {
    fn drop(&mut self) {
        // PID 1 of a PID namespace gone, the kernel kills everything else in it.
        if self.pid != 0 {
            let _ = nix::sys::signal::kill(
                nix::unistd::Pid::from_raw(self.pid as i32),
                nix::sys::signal::Signal::SIGKILL,
            );
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Makes the cpu, memory and pids controllers available in `root` (where the kernel offers them),
/// enabling them in each ancestor's subtree: runc's systemd driver sets each container's
/// cpu.weight, and on a host that does not run systemd nobody has enabled them.
fn delegate_controllers(root: &Path) {
    let mount = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
    let mut ancestors: Vec<&Path> = root
        .ancestors()
        .skip(1)
        .take_while(|a| a.starts_with(&mount))
        .collect();
    ancestors.reverse();
    for dir in ancestors {
        let available = std::fs::read_to_string(dir.join("cgroup.controllers")).unwrap_or_default();
        for controller in ["cpu", "memory", "pids"] {
            if available.split_whitespace().any(|c| c == controller) {
                let control = dir.join("cgroup.subtree_control");
                std::fs::write(&control, format!("+{controller}")).unwrap_or_else(|e| {
                    panic!("enabling {controller} in {}: {e}", control.display())
                });
            }
        }
    }
}

/// Moves `pid` into the cgroup (v2) of the calling process.
fn leave_for_own_cgroup(pid: u32) {
    let mount = capture_user::cgroup::cgroup2_mount().expect("cgroup2");
    let own = std::fs::read_to_string("/proc/self/cgroup").unwrap_or_default();
    let path = own
        .lines()
        .find_map(|l| l.strip_prefix("0::"))
        .expect("a cgroup v2 line in /proc/self/cgroup");
    let procs = mount
        .join(path.trim_start_matches('/'))
        .join("cgroup.procs");
    std::fs::write(&procs, pid.to_string())
        .unwrap_or_else(|e| panic!("moving {pid} into {}: {e}", procs.display()));
}

/// The host PID of the systemd that has moved into `root`'s init.scope (or `root` itself).
fn pid_of_systemd_in(root: &Path) -> Option<u32> {
    for dir in [root.join("init.scope"), root.to_path_buf()] {
        let procs = std::fs::read_to_string(dir.join("cgroup.procs")).unwrap_or_default();
        for pid in procs.lines().filter_map(|l| l.trim().parse::<u32>().ok()) {
            let exe = std::fs::read_link(format!("/proc/{pid}/exe")).unwrap_or_default();
            if exe.ends_with("systemd") {
                return Some(pid);
            }
        }
    }
    None
}
