//! `cargo xtask setup-check`: setup's Debian step run, unchanged, in a clean root of this
//! machine's Debian release, so that an install step that only works because a machine was
//! prepared by hand fails here instead of on a newcomer's machine.
//!
//! debootstrap makes a minimal root (`minbase`: the required packages and apt, nothing of ours),
//! this very xtask binary runs `setup --debian-only --vm` inside it with chroot, and then,
//! independently of setup's own verdict, every command of the tool tables must resolve inside
//! the root and dpkg there must list every package as installed. The root is removed afterwards.

use std::{
    ffi::CString,
    fs,
    path::{Path, PathBuf},
    process::Command,
    time::Instant,
};

use anyhow::{bail, ensure, Context as _, Result};

use super::{apt_sources, dpkg, tools};
use crate::run;

/// PATH inside the root: Debian's default for root.
const ROOT_PATH: &str = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin";

pub fn run_check(work: &Path) -> Result<()> {
    let started = Instant::now();
    super::install(tools::CHECK_TOOLS)?;
    let suite = apt_sources::codename()?;
    let mirror = apt_sources::debian_mirror(&suite)?;
    let root = CleanRoot::new(work.join("root"))?;

    println!(
        "setup-check: debootstrap --variant=minbase {suite} into {}",
        root.path.display()
    );
    run(Command::new("debootstrap")
        .args(["--variant=minbase", "--components=main", &suite])
        .arg(&root.path)
        .arg(&mirror))?;
    let bootstrapped = started.elapsed();

    let every_tool = [
        tools::TEST_TOOLS,
        tools::VM_TOOLS,
        &super::cross_compilers(),
    ]
    .concat();
    let packages = tools::packages(&every_tool);
    let admindir = root.path.join("var/lib/dpkg");
    let lacking = dpkg::missing(&packages, Some(&admindir))?;
    ensure!(
        !lacking.is_empty(),
        "the clean root already holds every package setup installs: the check would prove nothing"
    );
    println!("setup-check: the clean root lacks {}", lacking.join(" "));

    root.prepare()?;
    run(root
        .command("/usr/local/bin/xtask")
        .args(["setup", "--debian-only", "--vm"]))
    .context("setup's Debian step failed in the clean root")?;

    let mut failures: Vec<String> = every_tool
        .iter()
        .filter(|t| !root.resolves(t.command))
        .map(|t| format!("{} (from {}) is not there", t.command, t.package))
        .collect();
    failures.extend(
        dpkg::missing(&packages, Some(&admindir))?
            .into_iter()
            .map(|p| format!("dpkg does not list {p} as installed")),
    );
    if !failures.is_empty() {
        bail!(
            "after setup in a clean {suite} root:\n  {}",
            failures.join("\n  ")
        );
    }
    println!(
        "setup-check: passed: setup installed {} packages into a clean {suite} root and all {} \
         commands resolve ({:.0} s, of which debootstrap {:.0} s)",
        lacking.len(),
        every_tool.len(),
        started.elapsed().as_secs_f64(),
        bootstrapped.as_secs_f64()
    );
    Ok(())
}

/// A throwaway root directory; whatever is mounted in it is unmounted before it is removed, at
/// the start (a run killed half-way) and on drop.
struct CleanRoot {
    path: PathBuf,
}

impl CleanRoot {
    fn new(path: PathBuf) -> Result<Self> {
        remove_root(&path)?;
        fs::create_dir_all(&path)?;
        Ok(Self { path })
    }

    /// Makes the root usable by apt and by this binary: /proc, name resolution, no service
    /// starts from maintainer scripts, and the xtask binary itself (built for this release's
    /// libc, which the root shares).
    fn prepare(&self) -> Result<()> {
        mount_proc(&self.path.join("proc"))?;
        fs::copy("/etc/resolv.conf", self.path.join("etc/resolv.conf"))
            .context("copying /etc/resolv.conf into the clean root")?;
        let policy = self.path.join("usr/sbin/policy-rc.d");
        fs::write(&policy, "#!/bin/sh\nexit 101\n")?;
        set_mode(&policy, 0o755)?;
        let exe = std::env::current_exe().context("finding the xtask binary")?;
        let inside = self.path.join("usr/local/bin/xtask");
        fs::copy(&exe, &inside)
            .with_context(|| format!("copying {} into the clean root", exe.display()))?;
        Ok(())
    }

    /// `program` run inside the root, with root's default environment and nothing of ours.
    fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("chroot");
        cmd.arg(&self.path)
            .arg(program)
            .env_clear()
            .env("PATH", ROOT_PATH)
            .env("HOME", "/root")
            .env("LANG", "C")
            .env("DEBIAN_FRONTEND", "noninteractive");
        cmd
    }

    /// Whether `command` would run inside the root: a path is an executable file there, a
    /// name resolves on the root's PATH (asked of the root's own shell).
    fn resolves(&self, command: &str) -> bool {
        if let Some(relative) = command.strip_prefix('/') {
            return fs::metadata(self.path.join(relative)).is_ok_and(|m| m.is_file());
        }
        self.command("/bin/sh")
            .args(["-c", "command -v \"$1\" >/dev/null", "sh", command])
            .status()
            .is_ok_and(|s| s.success())
    }
}

impl Drop for CleanRoot {
    fn drop(&mut self) {
        if let Err(e) = remove_root(&self.path) {
            eprintln!("setup-check: {e:#}");
        }
    }
}

/// Unmounts everything mounted at or below `path`, then removes it. Refuses to remove a tree
/// that still has a mount in it: a bind mount of a host directory would be emptied with it.
fn remove_root(path: &Path) -> Result<()> {
    if !path.exists() {
        return Ok(());
    }
    let path = path.canonicalize()?;
    for mount in mounts_below(&path)?.iter().rev() {
        let target = CString::new(mount.as_os_str().as_encoded_bytes())?;
        // SAFETY: a valid NUL-terminated path; MNT_DETACH needs nothing else.
        if unsafe { libc::umount2(target.as_ptr(), libc::MNT_DETACH) } != 0 {
            bail!(
                "cannot unmount {}: {}",
                mount.display(),
                std::io::Error::last_os_error()
            );
        }
    }
    ensure!(
        mounts_below(&path)?.is_empty(),
        "{} still has mounts in it; not removing it",
        path.display()
    );
    fs::remove_dir_all(&path).with_context(|| format!("removing {}", path.display()))
}

/// Mount points at or below `path`, in the order they were mounted.
fn mounts_below(path: &Path) -> Result<Vec<PathBuf>> {
    let mounts = fs::read_to_string("/proc/self/mounts")?;
    Ok(mounts
        .lines()
        .filter_map(|l| l.split_whitespace().nth(1))
        .map(|m| PathBuf::from(m.replace("\\040", " ")))
        .filter(|m| m.starts_with(path))
        .collect())
}

fn mount_proc(target: &Path) -> Result<()> {
    fs::create_dir_all(target)?;
    let target_c = CString::new(target.as_os_str().as_encoded_bytes())?;
    // SAFETY: valid NUL-terminated strings; a null data pointer is allowed for proc.
    let rc = unsafe {
        libc::mount(
            c"proc".as_ptr(),
            target_c.as_ptr(),
            c"proc".as_ptr(),
            0,
            std::ptr::null(),
        )
    };
    if rc != 0 {
        bail!(
            "mounting proc on {}: {}",
            target.display(),
            std::io::Error::last_os_error()
        );
    }
    Ok(())
}

fn set_mode(path: &Path, mode: u32) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    fs::set_permissions(path, fs::Permissions::from_mode(mode))
        .with_context(|| format!("chmod {}", path.display()))
}
