//! RAII guards for everything a test creates in the kernel or on disk.

use std::{
    fs,
    io::{BufRead as _, BufReader},
    path::{Path, PathBuf},
    process::{Child, ChildStdout, Command, Stdio},
    time::Duration,
};

use crate::unique;

/// Runs a command, panicking with its stderr if it fails.
pub fn run(cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    assert!(
        out.status.success(),
        "{cmd:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `program`, to be run in the network namespace at `netns`: the child enters it between fork
/// and exec (what `nsenter --net` does, without a process of its own, which costs about 0.1 s
/// each under the kernel matrix's emulation).
pub fn in_netns(netns: &Path, program: impl AsRef<std::ffi::OsStr>) -> Command {
    use std::os::{fd::AsRawFd as _, unix::process::CommandExt as _};
    let ns = fs::File::open(netns)
        .unwrap_or_else(|e| panic!("opening the netns {}: {e}", netns.display()));
    let mut cmd = Command::new(program);
    // SAFETY: between fork and exec the child makes one system call on a descriptor the closure
    // owns (opened close-on-exec, so the program does not inherit it).
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
    cmd
}

/// What `iptables-<variant>-save ARGS` prints in the netns at `netns`; empty where that variant
/// holds no tables there.
pub fn saved_rules(netns: &Path, variant: &str, args: &[&str]) -> String {
    saved_rules_with(netns, &format!("iptables-{variant}-save"), args)
}

/// What the save tool `tool` prints in `netns` (empty where it prints nothing or fails).
pub fn saved_rules_with(netns: &Path, tool: &str, args: &[&str]) -> String {
    let mut cmd = in_netns(netns, tool);
    let out = cmd
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ip ARGS...`
pub fn ip(args: &[&str]) -> String {
    run(Command::new("ip").args(args))
}

/// `ip -n NETNS -batch -`: several commands in one run (a topology's set-up, one process per
/// netns rather than one per command, which counts under emulation).
pub fn ip_batch(netns: &str, commands: &[String]) {
    use std::io::Write as _;
    let mut child = Command::new("ip")
        .args(["-n", netns, "-batch", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("running ip -batch");
    child
        .stdin
        .take()
        .expect("piped")
        .write_all(commands.join("\n").as_bytes())
        .expect("writing ip's batch");
    let out = child.wait_with_output().expect("ip -batch");
    assert!(
        out.status.success(),
        "ip -n {netns} -batch failed: {}\n{}",
        String::from_utf8_lossy(&out.stderr),
        commands.join("\n")
    );
}

/// A named network namespace (`ip netns add`), deleted on drop.
pub struct NetnsGuard {
    pub name: String,
    /// For a netns owned by a user namespace of its own: the process holding both.
    holder: Option<ChildGuard>,
}

/// Where named netns are mounted, as `ip netns` keeps them.
const NETNS_RUN_DIR: &str = "/var/run/netns";

/// An empty file under `NETNS_RUN_DIR` to mount the netns `name` on, the directory made first as
/// `ip netns add` makes it: a shared mount point, so that netns mounted there later show in
/// every mount namespace that shares it.
fn netns_mount_point(name: &str) -> PathBuf {
    use nix::mount::{mount, MsFlags};
    static SHARED: std::sync::Once = std::sync::Once::new();
    let dir = Path::new(NETNS_RUN_DIR);
    SHARED.call_once(|| {
        fs::create_dir_all(dir).expect(NETNS_RUN_DIR);
        let shared = || {
            mount(
                None::<&str>,
                dir,
                Some("none"),
                MsFlags::MS_SHARED | MsFlags::MS_REC,
                None::<&str>,
            )
        };
        if shared().is_err() {
            // Not a mount point yet: make it one, on itself.
            mount(
                Some(dir),
                dir,
                Some("none"),
                MsFlags::MS_BIND | MsFlags::MS_REC,
                None::<&str>,
            )
            .expect("bind-mounting /var/run/netns on itself");
            shared().expect("making /var/run/netns a shared mount");
        }
    });
    let target = dir.join(name);
    fs::File::options()
        .write(true)
        .create_new(true)
        .open(&target)
        .unwrap_or_else(|e| panic!("creating {}: {e}", target.display()));
    target
}

impl NetnsGuard {
    /// A new named netns with its loopback up, made here as `ip netns add` makes one (a thread
    /// unshares its netns, which a bind mount then keeps): two processes less per netns, which
    /// cost about 0.2 s each under the kernel matrix's emulation.
    pub fn new(prefix: &str) -> Self {
        let name = unique(prefix);
        let target = netns_mount_point(&name);
        std::thread::scope(|s| {
            s.spawn(|| -> std::io::Result<()> {
                nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
                capture_user::netns::set_loopback_up()?;
                nix::mount::mount(
                    Some("/proc/thread-self/ns/net"),
                    &target,
                    None::<&str>,
                    nix::mount::MsFlags::MS_BIND,
                    None::<&str>,
                )?;
                Ok(())
            })
            .join()
            .expect("the netns thread panicked")
        })
        .unwrap_or_else(|e| panic!("making the netns {name}: {e}"));
        Self { name, holder: None }
    }

    /// A netns owned by a new user namespace whose ids 0..65536 are `outer_base` onwards on the
    /// node (a Kubernetes pod with `hostUsers: false`), named like any other.
    pub fn with_userns(prefix: &str, outer_base: u32) -> Self {
        let holder = ChildGuard::spawn_ready(Command::new(crate::probe_bin()).arg("userns-holder"));
        let pid = holder.pid();
        for map in ["uid_map", "gid_map"] {
            let path = format!("/proc/{pid}/{map}");
            fs::write(&path, format!("0 {outer_base} 65536\n"))
                .unwrap_or_else(|e| panic!("writing {path}: {e}"));
        }
        let name = unique(prefix);
        let target = netns_mount_point(&name);
        nix::mount::mount(
            Some(Path::new(&format!("/proc/{pid}/ns/net"))),
            &target,
            None::<&str>,
            nix::mount::MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("bind-mounting the netns of {pid}: {e}"));
        // Unmounted and removed on drop like any named netns.
        let guard = Self {
            name,
            holder: Some(holder),
        };
        capture_user::netns::Netns::open(&guard.path())
            .and_then(|ns| ns.run_in(capture_user::netns::set_loopback_up))
            .unwrap_or_else(|e| panic!("entering {}: {e}", guard.name))
            .unwrap_or_else(|e| panic!("setting lo up in {}: {e}", guard.name));
        guard
    }

    /// The user namespace that owns this netns, if it has one of its own.
    #[must_use]
    pub fn userns_path(&self) -> Option<PathBuf> {
        self.holder
            .as_ref()
            .map(|h| PathBuf::from(format!("/proc/{}/ns/user", h.pid())))
    }

    #[must_use]
    pub fn path(&self) -> PathBuf {
        Path::new(NETNS_RUN_DIR).join(&self.name)
    }
}

impl Drop for NetnsGuard {
    /// What `ip netns del` does: the mount goes (lazily, as processes may still be inside),
    /// then its file.
    fn drop(&mut self) {
        let path = self.path();
        let _ = nix::mount::umount2(&path, nix::mount::MntFlags::MNT_DETACH);
        let _ = fs::remove_file(&path);
    }
}

/// A cgroup v2 directory under the cgroup2 mount; its processes are killed and it is removed on
/// drop.
pub struct CgroupGuard {
    pub path: PathBuf,
}

impl CgroupGuard {
    pub fn new(prefix: &str) -> Self {
        let mount = capture_user::cgroup::cgroup2_mount().expect("cgroup2 mounted");
        let path = mount.join(unique(prefix));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Self { path }
    }

    /// A cgroup below this one (a container's below its pod's); drop it before its parent.
    #[must_use]
    pub fn child(&self, prefix: &str) -> Self {
        let path = self.path.join(unique(prefix));
        fs::create_dir(&path).unwrap_or_else(|e| panic!("mkdir {}: {e}", path.display()));
        Self { path }
    }

    /// Moves a running process into this cgroup.
    pub fn add(&self, pid: u32) {
        fs::write(self.path.join("cgroup.procs"), pid.to_string()).expect("write cgroup.procs");
    }
}

impl Drop for CgroupGuard {
    fn drop(&mut self) {
        let _ = fs::write(self.path.join("cgroup.kill"), "1");
        // Best effort: a guard that cannot clean up must not panic in a panic.
        let _ = crate::wait::poll_until(Duration::from_secs(5), || {
            fs::remove_dir(&self.path).map_err(drop)
        });
    }
}

/// A bpffs pin directory and a state directory for one test's `capture` runs.
pub struct CaptureDirs {
    pub bpffs: PathBuf,
    pub state: PathBuf,
    /// Only the owner removes the directories.
    owned: bool,
}

impl CaptureDirs {
    pub fn new() -> Self {
        let name = unique("capture-test");
        Self {
            bpffs: Path::new("/sys/fs/bpf").join(&name),
            state: std::env::temp_dir().join(name),
            owned: true,
        }
    }

    /// The same directories for another pod on the same "node"; the original still removes them.
    #[must_use]
    pub fn shared(&self) -> Self {
        Self {
            bpffs: self.bpffs.clone(),
            state: self.state.clone(),
            owned: false,
        }
    }
}

impl Default for CaptureDirs {
    fn default() -> Self {
        Self::new()
    }
}

impl Drop for CaptureDirs {
    fn drop(&mut self) {
        if !self.owned {
            return;
        }
        let _ = fs::remove_dir_all(&self.bpffs);
        let _ = fs::remove_dir_all(&self.state);
    }
}

/// A child process killed on drop. Its stdout stays open, so it can keep printing.
pub struct ChildGuard {
    pub child: Child,
    stdout: BufReader<ChildStdout>,
}

impl ChildGuard {
    /// Spawns `cmd` with its stdin and stdout piped, without waiting for anything.
    pub fn spawn(cmd: &mut Command) -> Self {
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
        let stdout = BufReader::new(child.stdout.take().expect("stdout"));
        Self { child, stdout }
    }

    /// Spawns `cmd` and waits for it to print `ready` (or `waiting`) on stdout.
    pub fn spawn_ready(cmd: &mut Command) -> Self {
        let mut guard = Self::spawn(cmd);
        let line = guard.read_line();
        assert!(
            matches!(line.trim(), "ready" | "waiting"),
            "{cmd:?} did not come up (printed {line:?})"
        );
        guard
    }

    #[must_use]
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a line to the child's stdin and reads one line of its answer.
    pub fn ask(&mut self, line: &str) -> String {
        use std::io::Write as _;
        let stdin = self.child.stdin.as_mut().expect("stdin");
        writeln!(stdin, "{line}").expect("write stdin");
        stdin.flush().expect("flush stdin");
        self.read_line()
    }

    /// The child's next line of output.
    pub fn read_line(&mut self) -> String {
        let mut line = String::new();
        let _ = self.stdout.read_line(&mut line);
        line
    }

    /// Sends a line to the child's stdin, then waits for it and returns the rest of its stdout.
    pub fn release_and_wait(mut self, line: &str) -> String {
        use std::io::{Read as _, Write as _};
        let mut stdin = self.child.stdin.take().expect("stdin");
        stdin.write_all(line.as_bytes()).expect("write stdin");
        drop(stdin);
        let mut rest = String::new();
        let _ = self.stdout.read_to_string(&mut rest);
        let _ = self.child.wait();
        rest
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A cgroup v1 hierarchy of its own (named, no controllers), mounted on a scratch directory: where
/// a node booted without cgroup v2 keeps its pods' cgroups. Unmounted on drop, after the
/// directories below it are removed (a v1 hierarchy with cgroups in it outlives its mount).
pub struct CgroupV1Mount {
    pub path: PathBuf,
    name: String,
}

impl CgroupV1Mount {
    /// `None` where this kernel does not let a v1 hierarchy be mounted (`cgroup_no_v1=named`).
    #[must_use]
    pub fn new() -> Option<Self> {
        let name = unique("capture-v1");
        let path = std::env::temp_dir().join(&name);
        fs::create_dir(&path).ok()?;
        if let Err(e) = Self::mount(&path, &name) {
            eprintln!(
                "cannot mount a cgroup v1 hierarchy on {}: {e}",
                path.display()
            );
            let _ = fs::remove_dir(&path);
            return None;
        }
        Some(Self { path, name })
    }

    /// The hierarchy's name (`name=` of its mount).
    #[must_use]
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Mounts the named hierarchy `name` (made by the first mount) on `path`.
    fn mount(path: &Path, name: &str) -> nix::Result<()> {
        let options = format!("none,name={name}");
        nix::mount::mount(
            Some("cgroup"),
            path,
            Some("cgroup"),
            nix::mount::MsFlags::empty(),
            Some(options.as_str()),
        )
    }

    /// Whether the kernel lets the hierarchy go within `wait`: every process is in its root
    /// until it goes.
    fn gone_within(&self, wait: Duration) -> bool {
        let member = format!(":name={}:", self.name);
        let deadline = std::time::Instant::now() + wait;
        loop {
            if !fs::read_to_string("/proc/self/cgroup").is_ok_and(|c| c.contains(&member)) {
                return true;
            }
            if std::time::Instant::now() > deadline {
                return false;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for CgroupV1Mount {
    fn drop(&mut self) {
        use nix::mount::{umount2, MntFlags};
        // Deepest first: a cgroup directory goes only once it has no children.
        for d in directory_tree(&self.path).iter().skip(1).rev() {
            let _ = fs::remove_dir(d);
        }
        let _ = umount2(&self.path, MntFlags::MNT_DETACH);
        // The kernel frees a removed cgroup after its last reference, and the hierarchy after its
        // last mount, both asynchronously: unmounted while a child was still going, the
        // hierarchy outlives its mount. Mounted and unmounted again once the children are gone,
        // it goes.
        for _ in 0..3 {
            if self.gone_within(Duration::from_millis(500)) {
                break;
            }
            if Self::mount(&self.path, &self.name).is_ok() {
                let _ = umount2(&self.path, MntFlags::MNT_DETACH);
            }
        }
        let _ = fs::remove_dir(&self.path);
    }
}

/// `root` and every directory below it, each before its children.
#[must_use]
pub fn directory_tree(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    let mut stack = vec![root.to_path_buf()];
    while let Some(d) = stack.pop() {
        if let Ok(entries) = fs::read_dir(&d) {
            stack.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
        dirs.push(d);
    }
    dirs
}

/// A directory made read-only in place (a read-only bind mount over itself) until dropped: what a
/// file system that refuses to remove a file looks like to the code under test.
pub struct ReadOnlyBind {
    path: PathBuf,
}

impl ReadOnlyBind {
    pub fn new(path: &Path) -> Self {
        use nix::mount::{mount, MsFlags};
        mount(
            Some(path),
            path,
            None::<&str>,
            MsFlags::MS_BIND,
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("bind-mounting {}: {e}", path.display()));
        let guard = Self {
            path: path.to_path_buf(),
        };
        mount(
            None::<&str>,
            path,
            None::<&str>,
            MsFlags::MS_BIND | MsFlags::MS_REMOUNT | MsFlags::MS_RDONLY,
            None::<&str>,
        )
        .unwrap_or_else(|e| panic!("making {} read-only: {e}", path.display()));
        guard
    }
}

impl Drop for ReadOnlyBind {
    fn drop(&mut self) {
        let _ = nix::mount::umount2(&self.path, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// A command's stdout and stderr, one after the other (for messages and `contains` checks).
#[must_use]
pub fn output_text(out: &std::process::Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// A file in a directory of its own, both removed on drop (a policy or mesh file a test hands
/// to capture).
pub struct TempFile {
    dir: PathBuf,
    pub path: PathBuf,
}

impl TempFile {
    pub fn new(name: &str, contents: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("capture-file"));
        fs::create_dir_all(&dir).unwrap_or_else(|e| panic!("mkdir {}: {e}", dir.display()));
        let path = dir.join(name);
        let file = Self { dir, path };
        file.write(contents);
        file
    }

    /// Replaces the content at once (a rename, as kubelet swaps a ConfigMap's files).
    pub fn write(&self, contents: &str) {
        let tmp = self.dir.join(".next");
        fs::write(&tmp, contents).unwrap_or_else(|e| panic!("write {}: {e}", tmp.display()));
        fs::rename(&tmp, &self.path)
            .unwrap_or_else(|e| panic!("rename to {}: {e}", self.path.display()));
    }
}

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = fs::remove_dir_all(&self.dir);
    }
}
