//! Listening sockets that predate the attach.
//!
//! The kernel side registers the proxy's inbound listener when the proxy calls `listen()`, and
//! gives sockets their netns when they are created; a proxy that already listens when its pod is
//! attached (a re-attach, a node moved from istio-init, pins rebuilt by an upgrade) did both
//! before any program ran. Without this, every inbound connection to such a pod is refused until
//! the proxy listens again, and on kernels whose sock_ops cannot ask for the netns cookie (before
//! 5.15) its outbound listener cannot tell the original destinations.
//!
//! So the pod's listeners on the proxy's ports are found and registered from here: the pod's
//! processes are those of its cgroup (in its netns); the sockets listening on those ports come
//! from `/proc/PID/net/tcp{,6}` of one of them, the file descriptors that hold them from
//! `/proc/PID/fd`, and `pidfd_getfd` gives capture its own descriptor for each, to put into the
//! listener map and to give a socket-local state (which the kernel clones into every accepted
//! socket). Every listener of a SO_REUSEPORT group gets its own slot.

use std::{
    collections::BTreeSet,
    fs, io,
    net::{IpAddr, SocketAddr},
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
};

use capture_common::{
    keys::{ListenerKey, LISTENER_SLOTS},
    state::{SockState, SOCK_INBOUND_LISTENER, SOCK_NETNS_KNOWN},
    AF_INET, AF_INET6,
};

use super::node::Maps;
use crate::{backend::PodTarget, config::CaptureConfig};

/// `BPF_NOEXIST`.
const NOEXIST: u64 = 1;
/// `TCP_LISTEN` in /proc/net/tcp's `st` column.
const TCP_LISTEN: &str = "0A";

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error("{0}")]
    Netns(String),
    #[error("reading {path}: {source}")]
    Read { path: String, source: io::Error },
    #[error("taking listener socket {inode} from pid {pid}: {source} (the agent needs CAP_SYS_PTRACE over the pod's processes)")]
    TakeFd {
        pid: u32,
        inode: u64,
        source: io::Error,
    },
    #[error("registering the {addr} listener for inbound capture: {reason}")]
    Register { addr: SocketAddr, reason: String },
}

/// What adoption registered.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Adopted {
    pub inbound: usize,
    pub outbound: usize,
}

/// Registers the pod's listeners on its inbound and outbound ports that capture does not know
/// yet. Call it with the pod's hooks attached, so that a listener opened meanwhile registers
/// itself; the pod's inbound entries must be empty (every listener found is added).
pub fn adopt_listeners(
    maps: &mut Maps,
    pod: &PodTarget<'_>,
    cfg: &CaptureConfig,
) -> Result<Adopted, AdoptError> {
    adopt_listeners_except(maps, pod, cfg, &mut BTreeSet::new())
}

/// As `adopt_listeners`, skipping the sockets whose cookies are in `seen` and adding those it
/// registers: a takeover that rebuilt the listener map registers, after the swap, the listeners
/// the old programs registered meanwhile, without taking a second slot for the others.
pub fn adopt_listeners_except(
    maps: &mut Maps,
    pod: &PodTarget<'_>,
    cfg: &CaptureConfig,
    seen: &mut BTreeSet<u64>,
) -> Result<Adopted, AdoptError> {
    let netns_cookie = pod.netns_cookie;
    let pids = pod_pids(pod)?;
    let Some(&first) = pids.first() else {
        return Ok(Adopted::default());
    };
    let ports = [cfg.inbound_port, cfg.outbound_port];
    let listening = listening_inodes(first, &ports)?;
    let mut adopted = Adopted::default();
    for (pid, fd, inode) in holders(&pids, &listening) {
        let socket =
            take_fd(pid, fd).map_err(|source| AdoptError::TakeFd { pid, inode, source })?;
        // The socket may have closed since the scan: nothing to adopt then.
        let Ok(addr) = local_addr(&socket) else {
            continue;
        };
        if socket_cookie(&socket).is_some_and(|cookie| !seen.insert(cookie)) {
            continue;
        }
        if addr.port() == cfg.inbound_port && accepts_inbound(addr.ip(), cfg) {
            register_inbound(maps, &socket, addr, netns_cookie)?;
            adopted.inbound += 1;
        } else if addr.port() == cfg.outbound_port {
            give_netns(maps, &socket, netns_cookie);
            adopted.outbound += 1;
        }
    }
    Ok(adopted)
}

/// The pod's processes: those of its cgroup tree that are in its netns.
fn pod_pids(pod: &PodTarget<'_>) -> Result<Vec<u32>, AdoptError> {
    let netns_ino = pod
        .netns
        .metadata()
        .map_err(|source| AdoptError::Read {
            path: pod.netns_path.display().to_string(),
            source,
        })?
        .ino();
    let mut pids = Vec::new();
    let mut dirs = vec![pod.cgroup_path.to_path_buf()];
    while let Some(dir) = dirs.pop() {
        let procs = dir.join("cgroup.procs");
        // A cgroup that went away meanwhile has no processes.
        let Ok(text) = fs::read_to_string(&procs) else {
            continue;
        };
        pids.extend(text.lines().filter_map(|l| l.trim().parse::<u32>().ok()));
        if let Ok(entries) = fs::read_dir(&dir) {
            dirs.extend(
                entries
                    .flatten()
                    .filter(|e| e.file_type().is_ok_and(|t| t.is_dir()))
                    .map(|e| e.path()),
            );
        }
    }
    pids.retain(|pid| {
        fs::metadata(format!("/proc/{pid}/ns/net")).is_ok_and(|m| m.ino() == netns_ino)
    });
    Ok(pids)
}

/// Inodes of the TCP sockets listening on `ports` in `pid`'s netns.
fn listening_inodes(pid: u32, ports: &[u16]) -> Result<BTreeSet<u64>, AdoptError> {
    let mut inodes = BTreeSet::new();
    for table in ["tcp", "tcp6"] {
        let path = format!("/proc/{pid}/net/{table}");
        let text = match fs::read_to_string(&path) {
            Ok(t) => t,
            // No IPv6 in the netns (or the process is gone).
            Err(e) if e.kind() == io::ErrorKind::NotFound => continue,
            Err(source) => return Err(AdoptError::Read { path, source }),
        };
        inodes.extend(
            text.lines()
                .skip(1)
                .filter_map(|line| listener_inode(line, ports)),
        );
    }
    Ok(inodes)
}

/// The inode of a /proc/net/tcp line's socket, if it listens on one of `ports`.
fn listener_inode(line: &str, ports: &[u16]) -> Option<u64> {
    let fields: Vec<&str> = line.split_whitespace().collect();
    let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
    let port = u16::from_str_radix(local.rsplit(':').next()?, 16).ok()?;
    (*state == TCP_LISTEN && ports.contains(&port))
        .then(|| inode.parse().ok())
        .flatten()
        .filter(|&inode| inode != 0)
}

/// (pid, fd, inode) for one descriptor of each socket in `inodes` held by `pids`.
fn holders(pids: &[u32], inodes: &BTreeSet<u64>) -> Vec<(u32, i32, u64)> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    for &pid in pids {
        let Ok(fds) = fs::read_dir(format!("/proc/{pid}/fd")) else {
            continue;
        };
        for entry in fds.flatten() {
            let Ok(target) = fs::read_link(entry.path()) else {
                continue;
            };
            let Some(inode) = target
                .to_str()
                .and_then(|t| t.strip_prefix("socket:["))
                .and_then(|t| t.strip_suffix(']'))
                .and_then(|t| t.parse::<u64>().ok())
            else {
                continue;
            };
            let Some(fd) = entry.file_name().to_str().and_then(|n| n.parse().ok()) else {
                continue;
            };
            if inodes.contains(&inode) && seen.insert(inode) {
                found.push((pid, fd, inode));
            }
        }
    }
    found
}

/// A descriptor of our own for `pid`'s `fd` (pidfd_getfd, Linux 5.6+).
fn take_fd(pid: u32, fd: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscalls; each returned descriptor is owned here and closed on drop.
    unsafe {
        let pidfd = libc::syscall(libc::SYS_pidfd_open, pid, 0);
        if pidfd < 0 {
            return Err(io::Error::last_os_error());
        }
        let pidfd = OwnedFd::from_raw_fd(pidfd as i32);
        let taken = libc::syscall(libc::SYS_pidfd_getfd, pidfd.as_raw_fd(), fd, 0);
        if taken < 0 {
            return Err(io::Error::last_os_error());
        }
        Ok(OwnedFd::from_raw_fd(taken as i32))
    }
}

fn local_addr(socket: &OwnedFd) -> io::Result<SocketAddr> {
    use nix::sys::socket::{getsockname, SockaddrLike as _, SockaddrStorage};
    let addr: SockaddrStorage = getsockname(socket.as_raw_fd()).map_err(io::Error::from)?;
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

/// The kernel's cookie of a socket (`SO_COOKIE`), which no other socket ever has.
fn socket_cookie(socket: &OwnedFd) -> Option<u64> {
    let mut cookie = 0u64;
    let mut len = size_of::<u64>() as libc::socklen_t;
    // SAFETY: `cookie` and `len` are valid for the kernel to write; the fd is ours.
    let rc = unsafe {
        libc::getsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(cookie)
}

/// Whether a listener on `ip` serves the pod's inbound traffic: the wildcard or a pod address,
/// as the kernel side registers them.
fn accepts_inbound(ip: IpAddr, cfg: &CaptureConfig) -> bool {
    ip.is_unspecified()
        || cfg.pod_ip4.is_some_and(|a| ip == IpAddr::V4(a))
        || cfg.pod_ip6.is_some_and(|a| ip == IpAddr::V6(a))
}

fn register_inbound(
    maps: &mut Maps,
    socket: &OwnedFd,
    addr: SocketAddr,
    netns_cookie: u64,
) -> Result<(), AdoptError> {
    let mut state = maps.socket_states.get(socket, 0).unwrap_or_default();
    state.netns_cookie = netns_cookie;
    state.flags |= SOCK_INBOUND_LISTENER | SOCK_NETNS_KNOWN;
    maps.socket_states
        .insert(socket, state, 0)
        .map_err(|e| AdoptError::Register {
            addr,
            reason: format!("its socket state: {e}"),
        })?;
    let family = u32::from(if addr.is_ipv6() { AF_INET6 } else { AF_INET });
    for slot in 0..LISTENER_SLOTS {
        let key = ListenerKey {
            netns_cookie,
            family,
            slot,
        };
        if maps
            .inbound_listeners
            .insert(key, socket.as_raw_fd(), NOEXIST)
            .is_ok()
        {
            return Ok(());
        }
    }
    Err(AdoptError::Register {
        addr,
        reason: format!("all {LISTENER_SLOTS} listener slots of the pod are taken"),
    })
}

/// Gives an outbound listener that has no socket state the pod's netns, which its accepted
/// sockets inherit (the sock_ops hook reads it where it cannot ask the kernel).
fn give_netns(maps: &mut Maps, socket: &OwnedFd, netns_cookie: u64) {
    let state = SockState {
        netns_cookie,
        flags: SOCK_NETNS_KNOWN,
        ..SockState::default()
    };
    // NOEXIST: a listener created after the attach already has its state.
    let _ = maps.socket_states.insert(socket, state, NOEXIST);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_listeners_on_the_ports_are_picked() {
        let header = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode";
        let listen_15006 = "   0: 00000000:3A9E 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1337        0 4242 1 0000000000000000 100 0 0 10 0";
        let established = "   1: 0A01000A:3A9E 0101000A:D431 01 00000000:00000000 00:00000000 00000000  1337        0 4343 1 0000000000000000 20 4 30 10 -1";
        let listen_8080 = "   2: 00000000:1F90 00000000:0000 0A 00000000:00000000 00:00000000 00000000  1000        0 4444 1 0000000000000000 100 0 0 10 0";
        assert_eq!(listener_inode(header, &[15006]), None);
        assert_eq!(listener_inode(listen_15006, &[15001, 15006]), Some(4242));
        assert_eq!(listener_inode(established, &[15006]), None);
        assert_eq!(listener_inode(listen_8080, &[15001, 15006]), None);
    }
}
