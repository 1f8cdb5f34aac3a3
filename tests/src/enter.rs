//! Entering a pod the way a container's process does: its cgroup, its netns, its identity.
//! Shared by the probe and the benchmark's roles.

use std::{io, path::Path};

/// Moves this process into the cgroup, then this thread into the netns.
pub fn join_pod(cgroup: Option<&Path>, netns: Option<&Path>) -> io::Result<()> {
    if let Some(cg) = cgroup {
        std::fs::write(cg.join("cgroup.procs"), "0")
            .map_err(|e| io::Error::new(e.kind(), format!("join cgroup {}: {e}", cg.display())))?;
    }
    if let Some(ns) = netns {
        let f = std::fs::File::open(ns)
            .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", ns.display())))?;
        nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET)
            .map_err(|e| io::Error::other(format!("setns {}: {e}", ns.display())))?;
    }
    Ok(())
}

/// Moves this (single-threaded) process into a pod's own user namespace: its ids from here on
/// are the pod's, which the node sees as others.
pub fn join_userns(userns: &Path) -> io::Result<()> {
    let f = std::fs::File::open(userns)
        .map_err(|e| io::Error::new(e.kind(), format!("open {}: {e}", userns.display())))?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWUSER)
        .map_err(|e| io::Error::other(format!("setns {}: {e}", userns.display())))
}

/// Makes this process the holder of a new user namespace and a netns it owns (a pod with
/// `hostUsers: false`); the caller writes its id maps.
pub fn unshare_user_and_net() -> io::Result<()> {
    nix::sched::unshare(
        nix::sched::CloneFlags::CLONE_NEWUSER | nix::sched::CloneFlags::CLONE_NEWNET,
    )
    .map_err(|e| io::Error::other(format!("unshare: {e}")))
}

fn check(rc: libc::c_int, what: &str) -> io::Result<()> {
    if rc == 0 {
        Ok(())
    } else {
        let e = io::Error::last_os_error();
        Err(io::Error::new(e.kind(), format!("{what}: {e}")))
    }
}

/// setresgid/setresuid keeping the saved ids root, so a later switch is still possible; also
/// leaves the working directory for `/`, as a container's process starts outside the checkout.
pub fn become_ids(uid: u32, gid: u32, groups: &[u32]) -> io::Result<()> {
    become_split_ids((uid, gid), (uid, gid), groups)
}

/// As `become_ids`, with effective (and so file-system) ids other than the real ones: what
/// seteuid, setfsuid or a setuid binary leaves a process with.
pub fn become_split_ids(real: (u32, u32), effective: (u32, u32), groups: &[u32]) -> io::Result<()> {
    // A process as another uid must not depend on the checkout's permissions: under /root
    // (0700) HAProxy refuses to start when it cannot return to its initial directory.
    std::env::set_current_dir("/")
        .map_err(|e| io::Error::new(e.kind(), format!("chdir /: {e}")))?;
    // SAFETY: plain credential syscalls.
    unsafe {
        check(libc::setresuid(0, 0, 0), "setresuid(0)")?;
        check(libc::setgroups(groups.len(), groups.as_ptr()), "setgroups")?;
        check(libc::setresgid(real.1, effective.1, 0), "setresgid")?;
        check(libc::setresuid(real.0, effective.0, 0), "setresuid")
    }
}
