//! A netns's cookie on kernels without `SO_NETNS_COOKIE` (before Linux 5.14), where only a BPF
//! program can ask for it: a `cgroup/sock_create` program (allowed to since Linux 5.7) on a scratch
//! cgroup, and a child process that joins that cgroup, enters the netns and creates one socket.

use std::{fs::File, io, os::fd::AsRawFd as _};

use aya::{
    maps::HashMap,
    programs::{CgroupAttachMode, CgroupSock},
    EbpfLoader,
};

use crate::cgroup::{CgroupJoin, ScratchCgroup};

/// The reporter program, built by build.rs from capture-ebpf's `netns-cookie` binary.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/netns-cookie.bpf.o"));

fn other(what: &str, e: impl std::fmt::Display) -> io::Error {
    io::Error::other(format!("{what}: {e}"))
}

/// The cookie of `netns`, as the kernel programs see it.
pub fn netns_cookie(netns: &File) -> io::Result<u64> {
    if OBJECT.is_empty() {
        return Err(io::Error::other(
            "this binary was built without kernel programs (CAPTURE_SKIP_EBPF_BUILD=1)",
        ));
    }
    let mut ebpf = EbpfLoader::new()
        .load(OBJECT)
        .map_err(|e| other("loading the netns-cookie reporter", e))?;
    let program: &mut CgroupSock = ebpf
        .program_mut("report_netns_cookie")
        .ok_or_else(|| io::Error::other("the reporter object has no program"))?
        .try_into()
        .map_err(|e| other("the reporter program", e))?;
    program
        .load()
        .map_err(|e| other("the kernel refused the netns-cookie reporter", e))?;
    // Dropped (removed) after the child has been reaped, so it is empty by then.
    let scratch = ScratchCgroup::create("netns-cookie")?;
    program
        .attach(File::open(&scratch.path)?, CgroupAttachMode::Single)
        .map_err(|e| other("attaching the netns-cookie reporter", e))?;
    create_socket_in(&CgroupJoin::new(&scratch.path)?, netns)?;
    let cookies: HashMap<_, u32, u64> = HashMap::try_from(
        ebpf.map("NETNS_COOKIES")
            .ok_or_else(|| io::Error::other("the reporter object has no map"))?,
    )
    .map_err(|e| other("the reporter map", e))?;
    // The one slot the reporter writes (capture-ebpf/src/netns_cookie.rs).
    cookies
        .get(&0, 0)
        .map_err(|e| other("the reporter saw no socket", e))
}

/// The child's exit code for a failed cgroup move is this plus the errno.
const JOIN_FAILED: i32 = 16;

/// Forks a child that moves into the scratch cgroup, enters `netns`, creates an IPv4 socket and
/// exits; returns once it has been reaped.
fn create_socket_in(join: &CgroupJoin, netns: &File) -> io::Result<()> {
    let netns_fd = netns.as_raw_fd();
    // SAFETY: between fork and _exit the child makes only raw system calls, which are
    // async-signal-safe, on fds the parent keeps open.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let code = if let Err(errno) = join.join_from_child() {
                JOIN_FAILED + errno.clamp(0, 200)
            } else if libc::setns(netns_fd, libc::CLONE_NEWNET) != 0 {
                2
            } else if libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0) < 0 {
                3
            } else {
                0
            };
            libc::_exit(code);
        }
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut status = 0;
    loop {
        // SAFETY: waits for our own child.
        if unsafe { libc::waitpid(pid, &raw mut status, 0) } == pid {
            break;
        }
        let err = io::Error::last_os_error();
        if err.kind() != io::ErrorKind::Interrupted {
            return Err(err);
        }
    }
    match (libc::WIFEXITED(status), libc::WEXITSTATUS(status)) {
        (true, 0) => Ok(()),
        (true, code) if code >= JOIN_FAILED => Err(io::Error::other(format!(
            "the child could not move: {}",
            join.explain(code - JOIN_FAILED)
        ))),
        (true, 2) => Err(io::Error::other("the child could not enter the netns")),
        (true, _) => Err(io::Error::other("the child could not create a socket")),
        _ => Err(io::Error::other("the child was killed")),
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_object_declares_the_kernel_crates_license() {
        assert_eq!(
            super::super::loader::declared_license(super::OBJECT),
            "Dual MIT/GPL"
        );
    }
}
