//! `capture sockets`: a pod's TCP connections as an operator wants to see them: each one's
//! addresses as the app sees them and as the packets carry them, where it was going, whether it
//! went through the proxy, and which hook decided it under which rule.
//!
//! `ss` cannot show this for capture's redirects: the kernel programs rewrite the app's
//! `connect()` to a loopback address of the proxy, so the socket's real peer is `127.x.y.z:15001`
//! and only the cgroup `getpeername` program gives the app the destination it asked for. Here
//! the kernel's view comes from `sock_diag` (`crate::sockdiag`, every socket of the netns with its
//! cookie and inode); the app's view from the socket itself: capture takes a descriptor of its
//! own for it (`pidfd_getfd`) and asks `getsockname`, `getpeername` and `SO_ORIGINAL_DST`, which
//! the kernel answers through the pod's programs because they run by the socket's cgroup, not the
//! caller's. For the ebpf backend the socket-local state the programs keep (`SOCKET_STATES`) says
//! which sockets they redirected. The kernel's BPF socket iterator would need a program of its
//! own per kernel floor (5.10 has `iter/tcp`, but no way to reach the app's view from it); the
//! descriptors give the app's view on every supported kernel.
//!
//! The holders are found in the node's /proc (`paths::host_proc`): the agent's container has the
//! node's at /host/proc and a PID namespace of its own, where `pidfd_open` of a node's PID would
//! name another process or none. There no descriptor is taken: each socket keeps its holder
//! (PID as the node numbers it) and the kernel's view, and the report says why the app's is
//! missing.
//!
//! The rule shown is the one the pod's configuration gives today (`capture explain`'s answer for
//! the connection); where that disagrees with what happened, the connection says so.

mod classify;
pub mod render;
#[cfg(test)]
mod tests;

use std::{collections::BTreeMap, net::SocketAddr, os::unix::fs::MetadataExt as _, path::PathBuf};

use aya::maps::{MapData, SkStorage};
use capture_common::state::SockState;
use netlink_packet_sock_diag::inet::StateFlags;
use serde::Serialize;

pub use self::classify::{classify, Observed};
use crate::{
    ebpf::node::open_socket_states,
    netns::{Netns, NetnsError},
    paths::Paths,
    record::{self, Mode, PodSelector},
    sockdiag::{self, SockDiagError},
    socket_fds::{
        command_in, fs_gid_in, held_sockets_in, is_gone, local_addr, netns_pids_in, original_dst,
        peer_addr, pids_are_ours, socket_cookie, unmapped, Process,
    },
};

#[derive(Debug, thiserror::Error)]
pub enum SocketsError {
    #[error("no captured pod matches {0}: `capture status` lists the pods capture knows")]
    UnknownPod(String),
    #[error(transparent)]
    Records(#[from] record::RecordError),
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error(transparent)]
    SockDiag(#[from] SockDiagError),
    #[error("reading pod {pod}'s netns {path}: {source}")]
    NetnsGone {
        pod: String,
        path: String,
        source: std::io::Error,
    },
}

/// Which end of which kind of connection a socket is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum Kind {
    /// A connection a process of the pod opened.
    Outbound,
    /// The proxy's end of an outbound connection redirected to its outbound port.
    ProxyOutbound,
    /// The proxy's end of an arriving connection redirected to its inbound port.
    ProxyInbound,
    /// A connection accepted by a listener of the pod other than the proxy's.
    Inbound,
}

/// The process holding a socket.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Holder {
    /// As the node numbers it (the node's /proc).
    pub pid: u32,
    pub command: String,
}

/// One TCP connection of the pod; the field names are stable (scripts read `--json`).
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Connection {
    pub kind: Kind,
    /// The TCP state as `ss` names it.
    pub state: &'static str,
    /// The process holding the socket; none for a connection still in a listener's queue.
    pub holder: Option<Holder>,
    /// The socket's owner (its file's uid), as the node sees it.
    pub uid: u32,
    /// The addresses as the app sees them (`getsockname`, `getpeername`); the kernel's where no
    /// process holds the socket.
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The addresses the packets carry (`sock_diag`), which differ for capture's redirects.
    pub kernel_local: SocketAddr,
    pub kernel_remote: SocketAddr,
    /// Where the connection was going: the app's destination for an outbound connection, the
    /// proxy's `SO_ORIGINAL_DST` answer for the proxy's ends.
    pub original_dst: Option<SocketAddr>,
    /// Whether the connection goes through the proxy (for an inbound one accepted by the app:
    /// whether the proxy opened it).
    pub via_proxy: bool,
    /// The hook (ebpf) or chain (iptables) that decided the connection; none for a connection
    /// within the pod that no hook decides.
    pub hook: Option<&'static str>,
    /// `redirect` or `pass`, as `capture trace` and `capture explain` say it.
    pub verdict: Option<&'static str>,
    /// The proxy's port for a redirect.
    pub port: Option<u16>,
    /// The rule the pod's configuration gives for the connection (`capture explain`'s name).
    pub rule: Option<&'static str>,
    /// The other end of the connection when it is in the pod too.
    pub peer: Option<Holder>,
    /// What disagrees: the connection was decided before capture or under another configuration.
    pub note: Option<String>,
    /// The kernel's cookie for the socket (what `capture trace` events name it by).
    pub cookie: u64,
}

/// A listening socket of the pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Listener {
    pub local: SocketAddr,
    pub holder: Option<Holder>,
    pub uid: u32,
    /// `outbound` or `inbound` for the proxy's ports.
    pub proxy_port: Option<&'static str>,
    /// For the proxy's inbound listener under the ebpf backend: whether the programs know it
    /// (registered at `listen()` or adopted); an unknown one gets no inbound connection.
    pub registered: Option<bool>,
}

/// What `capture sockets` shows; the field names are stable.
#[derive(Debug, Serialize)]
pub struct Report {
    pub pod: String,
    pub netns: String,
    pub backend: Mode,
    pub connections: Vec<Connection>,
    pub listeners: Vec<Listener>,
    /// Sockets in `TIME-WAIT`, which no process holds any more.
    pub time_wait: usize,
    pub notes: Vec<String>,
}

/// The pod's TCP sockets, each observed from the kernel and through its holder's descriptor.
///
/// # Errors
/// An unknown pod, a netns that is gone, or a kernel that refuses `sock_diag`.
pub fn sockets(paths: &Paths, which: &PodSelector) -> Result<Report, SocketsError> {
    let record = record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)?
        .ok_or_else(|| SocketsError::UnknownPod(which.to_string()))?;
    let pod = record.display_name();
    let netns = Netns::open(&record.netns)?;
    let netns_ino = netns
        .file()
        .metadata()
        .map_err(|source| SocketsError::NetnsGone {
            pod: pod.clone(),
            path: record.netns.display().to_string(),
            source,
        })?
        .ino();
    let kernel = sockdiag::tcp_sockets(&netns, StateFlags::all())?;
    let mut notes = Vec::new();
    let states = match record.mode {
        Mode::Ebpf => match open_socket_states(paths) {
            Ok(map) => Some(map),
            Err(e) => {
                notes.push(format!(
                    "the programs' socket states cannot be read ({e}): redirected sockets are told by their addresses only"
                ));
                None
            }
        },
        Mode::Iptables | Mode::Nftables => None,
    };
    let mut looker = Looker::new(netns_ino, states.as_ref());
    let observed: Vec<Observed> = kernel
        .into_iter()
        .map(|socket| looker.observe(socket, &record.config))
        .collect();
    if looker.denied > 0 {
        notes.push(format!(
            "{} sockets could not be taken from their processes (capture needs CAP_SYS_PTRACE over them): their app view is the kernel's",
            looker.denied
        ));
    }
    if looker.not_ours > 0 {
        notes.push(format!(
            "{} sockets show the kernel's addresses only, with no original destination and no state of the programs: the app's view is asked through a descriptor of each socket, which capture takes (pidfd_getfd) only from processes of its own PID namespace, and this process's is not the node's (an agent's container without hostPID); run `capture sockets` on the node for it",
            looker.not_ours
        ));
    }
    let (connections, listeners, time_wait) = classify(&observed, &record.config, record.mode);
    Ok(Report {
        pod,
        netns: record.netns.display().to_string(),
        backend: record.mode,
        connections,
        listeners,
        time_wait,
        notes,
    })
}

/// Observes sockets through their holders' descriptors.
struct Looker<'m> {
    /// The node's /proc, where the holders are found.
    proc: PathBuf,
    /// Whether its PIDs are ours, so that descriptors may be taken from them.
    pids_ours: bool,
    /// Socket inode → the process holding it and its descriptor number there.
    held: BTreeMap<u64, (u32, i32)>,
    /// Each holding process once: its descriptor taker, who it is, and its fs gid.
    processes: BTreeMap<u32, (Process, Holder, Option<u32>)>,
    states: Option<&'m SkStorage<MapData, SockState>>,
    denied: usize,
    /// Held sockets whose descriptor was not taken: their holder's PID is not ours.
    not_ours: usize,
}

impl<'m> Looker<'m> {
    fn new(netns_ino: u64, states: Option<&'m SkStorage<MapData, SockState>>) -> Self {
        let proc = crate::paths::host_proc();
        let mut held = BTreeMap::new();
        for pid in netns_pids_in(&proc, netns_ino) {
            for (fd, inode) in held_sockets_in(&proc, pid) {
                held.entry(inode).or_insert((pid, fd));
            }
        }
        Self {
            pids_ours: pids_are_ours(&proc),
            proc,
            held,
            processes: BTreeMap::new(),
            states,
            denied: 0,
            not_ours: 0,
        }
    }

    fn observe(
        &mut self,
        kernel: sockdiag::KernelSocket,
        cfg: &crate::config::CaptureConfig,
    ) -> Observed {
        let mut seen = Observed::kernel_only(kernel);
        let Some(&(pid, fd)) = self.held.get(&seen.kernel.inode) else {
            return seen;
        };
        let proc = &self.proc;
        let (process, holder, gid) = self.processes.entry(pid).or_insert_with(|| {
            let holder = Holder {
                pid,
                command: command_in(proc, pid),
            };
            (Process::new(pid), holder, fs_gid_in(proc, pid))
        });
        seen.holder = Some(holder.clone());
        seen.fs_gid = *gid;
        if !self.pids_ours {
            self.not_ours += 1;
            return seen;
        }
        let socket = match process.take(fd) {
            Ok(s) => s,
            Err(e) => {
                if !is_gone(&e) {
                    self.denied += 1;
                }
                return seen;
            }
        };
        // An inode reused since the listing is another socket: keep the kernel's view only.
        if socket_cookie(&socket) != Some(seen.kernel.cookie) {
            return seen;
        }
        seen.app_local = local_addr(&socket).ok().map(unmapped);
        seen.app_remote = peer_addr(&socket).ok().map(unmapped);
        seen.state = self.states.and_then(|map| map.get(&socket, 0).ok());
        if classify::may_be_proxy_end(&seen, cfg) {
            seen.original = original_dst(&socket, seen.kernel.ipv6);
        }
        seen
    }
}
