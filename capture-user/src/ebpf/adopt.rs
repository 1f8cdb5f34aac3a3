//! Listening sockets that predate the attach.
//!
//! The kernel side registers the proxy's inbound listener when the proxy calls `listen()`, and
//! gives sockets their netns when they are created; a proxy that already listens when its pod is
//! attached (a re-attach, a node moved from istio-init, pins rebuilt by an upgrade) did both
//! before any program ran. Without this, every inbound connection to such a pod is refused until
//! the proxy listens again, and on kernels whose `sock_ops` cannot ask for the netns cookie (before
//! 5.15) its outbound listener cannot tell the original destinations.
//!
//! So the pod's listeners on the proxy's ports are found and registered from here. Where the
//! pod's processes are outside this process's PID namespace (an agent without `hostPID`), the
//! kernel registers them (`adopt_kernel`). Otherwise the pod's
//! processes are those of its cgroup (in its netns); `pidfd_getfd` gives capture its own
//! descriptor for each socket they hold (`/proc/PID/fd`), and the socket itself says whether it
//! is a TCP listener of the pod's netns and on which port. That descriptor goes into the
//! listener map and gets a socket-local state (which the kernel clones into every accepted
//! socket). Every listener of a `SO_REUSEPORT` group gets its own slot. The netns's socket table
//! (`/proc/PID/net/tcp`) is not read: the kernel walks its whole established-connection hash
//! for it, which cost every CNI ADD about 2 ms per table on a machine with 24 GiB.

use std::{
    collections::BTreeSet,
    fs, io,
    net::{IpAddr, SocketAddr},
    os::{
        fd::{AsRawFd as _, OwnedFd},
        unix::fs::MetadataExt as _,
    },
};

use capture_common::{
    keys::{ListenerKey, LISTENER_SLOTS},
    state::{SockState, SOCK_INBOUND_LISTENER, SOCK_NETNS_KNOWN},
    AF_INET, AF_INET6,
};

use super::node::Maps;
use crate::{
    backend::PodTarget,
    config::CaptureConfig,
    socket_fds::{
        held_sockets, in_netns, int_option, is_gone, local_addr, socket_cookie, socket_netns,
        Process,
    },
};

/// `BPF_NOEXIST`.
const NOEXIST: u64 = 1;

#[derive(Debug, thiserror::Error)]
pub enum AdoptError {
    #[error(transparent)]
    Open(#[from] crate::backend::OpenPodError),
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
    #[error("registering the listeners of netns {netns} in the kernel: {reason}")]
    Kernel { netns: String, reason: String },
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
    let netns_ino = pod
        .netns
        .metadata()
        .map_err(|source| AdoptError::Read {
            path: pod.netns_path.display().to_string(),
            source,
        })?
        .ino();
    let pids = match pod_pids(pod, netns_ino) {
        PodPids::Ours(pids) => pids,
        // Their descriptors are out of reach: the kernel registers what sock_diag lists. The
        // sockets already registered are left alone there, so `seen` is not needed.
        PodPids::OutsideOurPidNamespace => {
            return super::adopt_kernel::adopt_in_kernel(&maps.dir, pod, cfg);
        }
    };
    let ports = [cfg.inbound_port, cfg.outbound_port];
    let mut adopted = Adopted::default();
    for (socket, addr) in pod_listeners(&pids, netns_ino, &ports)? {
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

/// The pod's processes as this process's PID namespace numbers them.
enum PodPids {
    /// Those of its cgroup tree that are in its netns.
    Ours(Vec<u32>),
    /// Some are outside our PID namespace (an agent without `hostPID`): `cgroup.procs` lists
    /// them as 0, and `pidfd_open` cannot reach them.
    OutsideOurPidNamespace,
}

fn pod_pids(pod: &PodTarget<'_>, netns_ino: u64) -> PodPids {
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
    if pids.contains(&0) {
        return PodPids::OutsideOurPidNamespace;
    }
    pids.retain(|&pid| in_netns(pid, netns_ino));
    PodPids::Ours(pids)
}

/// A descriptor of our own for each TCP socket that `pids` hold, listens on one of `ports`
/// and belongs to the netns `netns_ino`, once per socket, with its address.
fn pod_listeners(
    pids: &[u32],
    netns_ino: u64,
    ports: &[u16],
) -> Result<Vec<(OwnedFd, SocketAddr)>, AdoptError> {
    let mut found = Vec::new();
    let mut seen = BTreeSet::new();
    for &pid in pids {
        let mut process = Process::new(pid);
        for (fd, inode) in held_sockets(pid) {
            if !seen.insert(inode) {
                continue;
            }
            let socket = match process.take(fd) {
                Ok(s) => s,
                // The process or the descriptor is gone since the scan: nothing to adopt.
                Err(e) if is_gone(&e) => continue,
                Err(source) => return Err(AdoptError::TakeFd { pid, inode, source }),
            };
            let Some(addr) = tcp_listener_on(&socket, ports) else {
                continue;
            };
            if socket_netns(&socket).is_ok_and(|ino| ino == netns_ino) {
                found.push((socket, addr));
            }
        }
    }
    Ok(found)
}

/// The address of `socket` if it is a TCP socket listening on one of `ports`.
fn tcp_listener_on(socket: &OwnedFd, ports: &[u16]) -> Option<SocketAddr> {
    let listening = int_option(socket, libc::SO_ACCEPTCONN)? == 1;
    let tcp = int_option(socket, libc::SO_PROTOCOL)? == libc::IPPROTO_TCP;
    if !(listening && tcp) {
        return None;
    }
    local_addr(socket)
        .ok()
        .filter(|addr| ports.contains(&addr.port()))
}

/// Whether a listener on `ip` serves the pod's inbound traffic: the wildcard or a pod address,
/// as the kernel side registers them.
pub(super) fn accepts_inbound(ip: IpAddr, cfg: &CaptureConfig) -> bool {
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
/// sockets inherit (the `sock_ops` hook reads it where it cannot ask the kernel).
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
    fn only_tcp_listeners_on_the_ports_are_picked() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("a listener");
        let port = listener.local_addr().expect("its address").port();
        let client = std::net::TcpStream::connect(("127.0.0.1", port)).expect("a connection");
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").expect("a UDP socket");
        let udp_port = udp.local_addr().expect("its address").port();
        let owned = |fd: std::os::fd::BorrowedFd<'_>| fd.try_clone_to_owned().expect("a dup");
        use std::os::fd::AsFd as _;
        assert_eq!(
            tcp_listener_on(&owned(listener.as_fd()), &[15001, port]),
            Some(SocketAddr::from(([127, 0, 0, 1], port)))
        );
        assert_eq!(tcp_listener_on(&owned(listener.as_fd()), &[15001]), None);
        let client_port = client.local_addr().expect("its address").port();
        assert_eq!(
            tcp_listener_on(&owned(client.as_fd()), &[port, client_port]),
            None
        );
        assert_eq!(tcp_listener_on(&owned(udp.as_fd()), &[udp_port]), None);
    }
}
