//! Other processes' sockets: which sockets a process holds (`/proc/PID/fd`), a descriptor of our
//! own for one of them (`pidfd_getfd`, Linux 5.6+, which needs `CAP_SYS_PTRACE` over the
//! process), and what the socket itself says.
//!
//! The `_in` functions read a given /proc, the node's (`paths::host_proc`) among them, whose PIDs
//! need not be valid in our PID namespace: `pids_are_ours` says whether they are, and only then
//! may one of them be given to `Process` (`pidfd_open` of a node's PID in a container's PID
//! namespace names another process, or none).
//!
//! Calls on a descriptor taken this way behave as in the process that holds it, not as in ours,
//! wherever the kernel decides by the socket: the cgroup `getpeername`, `getsockname` and
//! `getsockopt` programs run by the socket's cgroup, so `peer_addr` answers what the app sees.

use std::{
    fs, io,
    net::SocketAddr,
    os::{
        fd::{AsFd, AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
    path::Path,
};

const OWN_PROC: &str = "/proc";

/// Whether the PIDs of the /proc at `proc` are those of our PID namespace: its `self` lists one
/// PID in `NSpid`, from that /proc's namespace down to ours, only when the two are one.
#[must_use]
pub fn pids_are_ours(proc: &Path) -> bool {
    fs::read_to_string(proc.join("self/status")).is_ok_and(|status| {
        status
            .lines()
            .find_map(|l| l.strip_prefix("NSpid:"))
            .is_some_and(|pids| pids.split_whitespace().count() == 1)
    })
}

/// The sockets `pid` holds: its descriptor numbers with their socket inodes.
#[must_use]
pub fn held_sockets(pid: u32) -> Vec<(i32, u64)> {
    held_sockets_in(Path::new(OWN_PROC), pid)
}

/// The sockets `pid` of the /proc at `proc` holds.
#[must_use]
pub fn held_sockets_in(proc: &Path, pid: u32) -> Vec<(i32, u64)> {
    let Ok(fds) = fs::read_dir(proc.join(format!("{pid}/fd"))) else {
        return Vec::new();
    };
    fds.flatten()
        .filter_map(|entry| {
            let inode = fs::read_link(entry.path()).ok().and_then(|t| {
                t.to_str()?
                    .strip_prefix("socket:[")?
                    .strip_suffix(']')?
                    .parse::<u64>()
                    .ok()
            })?;
            let fd = entry.file_name().to_str()?.parse().ok()?;
            Some((fd, inode))
        })
        .collect()
}

/// A process whose descriptors we take, opened on the first one asked for (most processes of a
/// pod, the sandbox's first, hold no socket).
pub struct Process {
    pub pid: u32,
    pidfd: Option<OwnedFd>,
}

impl Process {
    #[must_use]
    pub fn new(pid: u32) -> Self {
        Self { pid, pidfd: None }
    }

    /// A descriptor of our own for the process's `fd`. `ESRCH` or `EBADF` when the process or
    /// the descriptor went away since it was listed.
    ///
    /// # Errors
    /// As `pidfd_open` and `pidfd_getfd`.
    pub fn take(&mut self, fd: i32) -> io::Result<OwnedFd> {
        let pidfd = match &self.pidfd {
            Some(p) => p,
            None => self.pidfd.insert(open_pidfd(self.pid)?),
        };
        // SAFETY: a plain syscall; the descriptor is owned at once.
        unsafe {
            let taken = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
            if taken < 0 {
                return Err(io::Error::last_os_error());
            }
            Ok(OwnedFd::from_raw_fd(taken as i32))
        }
    }

    /// The process's command name (`/proc/PID/comm`), empty once it is gone.
    #[must_use]
    pub fn command(&self) -> String {
        command_in(Path::new(OWN_PROC), self.pid)
    }
}

/// The command name of `pid` of the /proc at `proc`, empty once it is gone.
#[must_use]
pub fn command_in(proc: &Path, pid: u32) -> String {
    fs::read_to_string(proc.join(format!("{pid}/comm")))
        .map(|c| c.trim_end().to_owned())
        .unwrap_or_default()
}

/// Whether an error of `Process::take` means only that the process or descriptor is gone.
#[must_use]
pub fn is_gone(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::ESRCH | libc::EBADF))
}

fn open_pidfd(pid: u32) -> io::Result<OwnedFd> {
    // SAFETY: a plain syscall; the descriptor is owned at once.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(pidfd as i32))
    }
}

/// The processes in the netns whose inode is `netns_ino`, from the /proc at `proc`.
#[must_use]
pub fn netns_pids_in(proc: &Path, netns_ino: u64) -> Vec<u32> {
    let Ok(entries) = fs::read_dir(proc) else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = entries
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|pid| in_netns_in(proc, *pid, netns_ino))
        .collect();
    pids.sort_unstable();
    pids
}

/// Whether `pid` is in the netns whose inode is `netns_ino`.
#[must_use]
pub fn in_netns(pid: u32, netns_ino: u64) -> bool {
    in_netns_in(Path::new(OWN_PROC), pid, netns_ino)
}

fn in_netns_in(proc: &Path, pid: u32, netns_ino: u64) -> bool {
    fs::metadata(proc.join(format!("{pid}/ns/net"))).is_ok_and(|m| m.ino() == netns_ino)
}

/// An integer `SOL_SOCKET` option.
pub fn int_option(socket: impl AsFd, name: libc::c_int) -> Option<libc::c_int> {
    let mut value: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `value` and `len` are valid for the kernel to write; the fd is borrowed.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            name,
            (&raw mut value).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(value)
}

/// The kernel's cookie of a socket (`SO_COOKIE`), which no other socket ever has.
pub fn socket_cookie(socket: impl AsFd) -> Option<u64> {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for the kernel to write; the fd is borrowed.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_fd().as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(cookie)
}

/// The inode of the netns `socket` belongs to (`SIOCGSKNS`, Linux 4.9+).
///
/// # Errors
/// The ioctl fails.
pub fn socket_netns(socket: impl AsFd) -> io::Result<u64> {
    /// `SIOCGSKNS` from linux/sockios.h.
    const SIOCGSKNS: libc::c_ulong = 0x894C;
    // SAFETY: the ioctl returns a new descriptor, owned at once.
    let netns = unsafe {
        let fd = libc::ioctl(socket.as_fd().as_raw_fd(), SIOCGSKNS);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        fs::File::from(OwnedFd::from_raw_fd(fd))
    };
    Ok(netns.metadata()?.ino())
}

/// The socket's local address as a process that holds it sees it (`getsockname`).
///
/// # Errors
/// Not an inet socket, or the call fails.
pub fn local_addr(socket: impl AsFd) -> io::Result<SocketAddr> {
    inet_addr(nix::sys::socket::getsockname(socket.as_fd().as_raw_fd()))
}

/// The socket's peer as a process that holds it sees it (`getpeername`).
///
/// # Errors
/// Not an inet socket, not connected, or the call fails.
pub fn peer_addr(socket: impl AsFd) -> io::Result<SocketAddr> {
    inet_addr(nix::sys::socket::getpeername(socket.as_fd().as_raw_fd()))
}

fn inet_addr(addr: nix::Result<nix::sys::socket::SockaddrStorage>) -> io::Result<SocketAddr> {
    use nix::sys::socket::SockaddrLike as _;
    let addr = addr.map_err(io::Error::from)?;
    if let Some(v4) = addr.as_sockaddr_in() {
        return Ok(SocketAddr::from((v4.ip(), v4.port())));
    }
    if let Some(v6) = addr.as_sockaddr_in6() {
        return Ok(SocketAddr::from((v6.ip(), v6.port())));
    }
    Err(io::Error::other(format!(
        "not an inet socket (family {:?})",
        addr.family()
    )))
}

/// The socket's original destination as the proxy asks it (`SO_ORIGINAL_DST` at `SOL_IP`, or
/// `IP6T_SO_ORIGINAL_DST` at `SOL_IPV6` for an IPv6 socket): conntrack's answer, or capture's
/// `getsockopt` program's for a socket of a captured cgroup.
pub fn original_dst(socket: impl AsFd, ipv6: bool) -> Option<SocketAddr> {
    use nix::sys::socket::{getsockopt, sockopt};
    if ipv6 {
        let a = getsockopt(&socket, sockopt::Ip6tOriginalDst).ok()?;
        let ip = std::net::Ipv6Addr::from(a.sin6_addr.s6_addr);
        Some(unmapped(SocketAddr::new(
            ip.into(),
            u16::from_be(a.sin6_port),
        )))
    } else {
        let a = getsockopt(&socket, sockopt::OriginalDst).ok()?;
        let ip = std::net::Ipv4Addr::from(u32::from_be(a.sin_addr.s_addr));
        Some(SocketAddr::from((ip, u16::from_be(a.sin_port))))
    }
}

/// An IPv4 address of an IPv6 socket (`::ffff:a.b.c.d`) as the IPv4 address it is.
#[must_use]
pub fn unmapped(addr: SocketAddr) -> SocketAddr {
    match addr {
        SocketAddr::V6(v6) => v6
            .ip()
            .to_ipv4_mapped()
            .map_or(addr, |v4| SocketAddr::from((v4, v6.port()))),
        SocketAddr::V4(_) => addr,
    }
}

/// The fs gid of `pid` of the /proc at `proc` (its `status`), which a socket it creates is owned
/// by.
#[must_use]
pub fn fs_gid_in(proc: &Path, pid: u32) -> Option<u32> {
    let status = fs::read_to_string(proc.join(format!("{pid}/status"))).ok()?;
    let line = status.lines().find_map(|l| l.strip_prefix("Gid:"))?;
    line.split_whitespace().nth(3)?.parse().ok()
}
