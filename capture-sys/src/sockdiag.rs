//! A netns's TCP sockets as the kernel holds them, asked over `sock_diag`
//! (`NETLINK_SOCK_DIAG`, the interface `ss` uses), not read from `/proc/net/tcp{,6}`: the answer
//! is binary, carries every socket's cookie (`SO_COOKIE`, which the kernel programs key their
//! state by) and inode, and can be limited to the states asked for. Either way the kernel walks
//! the node's socket hashes, so this is for on-demand commands (`capture sockets`, `capture
//! explain`), never a CNI ADD.

use std::{io, net::SocketAddr};

/// The states `tcp_sockets` asks for.
pub use netlink_packet_sock_diag::inet::StateFlags;

use netlink_packet_sock_diag::{
    constants::{AF_INET, AF_INET6, IPPROTO_TCP},
    inet::{ExtensionFlags, InetRequest, InetResponse, SocketId},
    SockDiagMessage,
};
use netlink_sys::{protocols::NETLINK_SOCK_DIAG, Socket};

use crate::{
    netlink,
    netns::{Netns, NetnsError},
    socket_fds::unmapped,
};

#[derive(Debug, thiserror::Error)]
pub enum SockDiagError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("asking the kernel for the TCP sockets of netns {netns} (sock_diag): {source}")]
    Netlink { netns: String, source: io::Error },
}

/// `TCP_LISTEN` from the kernel's `tcp_states.h`.
pub const TCP_LISTEN: u8 = 10;
/// `TCP_TIME_WAIT`.
pub const TCP_TIME_WAIT: u8 = 6;

/// One TCP socket of the netns, with its real addresses (what the packets carry).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelSocket {
    /// The kernel's cookie for the socket (`SO_COOKIE`).
    pub cookie: u64,
    /// Its inode (`socket:[N]` in `/proc/PID/fd`); 0 for a socket no descriptor holds
    /// (`TIME_WAIT`, an orphan).
    pub inode: u64,
    /// `TCP_*` from `tcp_states.h`.
    pub state: u8,
    pub local: SocketAddr,
    pub remote: SocketAddr,
    /// The uid of the socket's file, as `ss -e` shows it.
    pub uid: u32,
    /// An `AF_INET6` socket (its IPv4 peers are shown as IPv4 addresses).
    pub ipv6: bool,
}

impl KernelSocket {
    #[must_use]
    pub fn is_listener(&self) -> bool {
        self.state == TCP_LISTEN
    }
}

/// The state's name as `ss` prints it.
#[must_use]
pub fn state_name(state: u8) -> &'static str {
    match state {
        1 => "ESTAB",
        2 => "SYN-SENT",
        3 => "SYN-RECV",
        4 => "FIN-WAIT-1",
        5 => "FIN-WAIT-2",
        TCP_TIME_WAIT => "TIME-WAIT",
        7 => "CLOSE",
        8 => "CLOSE-WAIT",
        9 => "LAST-ACK",
        TCP_LISTEN => "LISTEN",
        11 => "CLOSING",
        12 => "NEW-SYN-RECV",
        _ => "UNKNOWN",
    }
}

/// Every TCP socket of `netns` in one of `states` (IPv4 and IPv6).
///
/// # Errors
/// The netns cannot be entered or the kernel refuses the request.
pub fn tcp_sockets(netns: &Netns, states: StateFlags) -> Result<Vec<KernelSocket>, SockDiagError> {
    let failed = |source: io::Error| SockDiagError::Netlink {
        netns: netns.path().display().to_string(),
        source,
    };
    let socket = netlink::socket_in(netns, NETLINK_SOCK_DIAG)?.map_err(failed)?;
    let mut found = Vec::new();
    for family in [AF_INET, AF_INET6] {
        dump(&socket, family, states.clone(), &mut found).map_err(failed)?;
    }
    Ok(found)
}

/// Whether a TCP socket of `netns` listens on `port` (any address, either family).
///
/// # Errors
/// As `tcp_sockets`.
pub fn listening(netns: &Netns, port: u16) -> Result<bool, SockDiagError> {
    Ok(tcp_sockets(netns, StateFlags::LISTEN)?
        .iter()
        .any(|s| s.local.port() == port))
}

/// The TCP connections of `netns` that are open or opening (not listeners, not `TIME_WAIT`).
///
/// # Errors
/// As `tcp_sockets`.
pub fn open_connections(netns: &Netns) -> Result<Vec<KernelSocket>, SockDiagError> {
    let open = StateFlags::ESTABLISHED
        | StateFlags::SYN_SENT
        | StateFlags::SYN_RECV
        | StateFlags::FIN_WAIT1
        | StateFlags::FIN_WAIT2
        | StateFlags::CLOSE_WAIT;
    tcp_sockets(netns, open)
}

fn dump(
    socket: &Socket,
    family: u8,
    states: StateFlags,
    found: &mut Vec<KernelSocket>,
) -> io::Result<()> {
    let request = SockDiagMessage::InetRequest(InetRequest {
        family,
        protocol: IPPROTO_TCP,
        extensions: ExtensionFlags::empty(),
        states,
        socket_id: if family == AF_INET {
            SocketId::new_v4()
        } else {
            SocketId::new_v6()
        },
    });
    netlink::dump(socket, request, |answer| {
        if let SockDiagMessage::InetResponse(response) = answer {
            found.push(kernel_socket(&response));
        }
    })
}

fn kernel_socket(response: &InetResponse) -> KernelSocket {
    let id = &response.header.socket_id;
    // The kernel stores the cookie as two host-order words, the low one first.
    let (low, high) = id.cookie.split_at(4);
    let word = |b: &[u8]| u64::from(u32::from_ne_bytes(b.try_into().unwrap_or_default()));
    KernelSocket {
        cookie: word(low) | (word(high) << 32),
        inode: u64::from(response.header.inode),
        state: response.header.state,
        local: unmapped(SocketAddr::new(id.source_address, id.source_port)),
        remote: unmapped(SocketAddr::new(id.destination_address, id.destination_port)),
        uid: response.header.uid,
        ipv6: response.header.family == AF_INET6,
    }
}

#[cfg(test)]
mod tests {
    use std::net::{TcpListener, TcpStream};

    use super::*;

    /// The test's own netns (the test process's), as a `Netns`.
    fn here() -> Netns {
        Netns::open(std::path::Path::new("/proc/self/ns/net")).expect("our netns")
    }

    #[test]
    fn a_connection_and_its_listener_are_found_with_their_cookies() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("a listener");
        let addr = listener.local_addr().expect("its address");
        let client = TcpStream::connect(addr).expect("a connection");
        let (accepted, _) = listener.accept().expect("accepted");
        let sockets = match tcp_sockets(&here(), StateFlags::all()) {
            Ok(s) => s,
            // Without CAP_NET_ADMIN the dump still answers; a kernel without inet_diag does not.
            Err(e) => panic!("sock_diag: {e}"),
        };
        let client_side = sockets
            .iter()
            .find(|s| s.local == client.local_addr().expect("its address"))
            .expect("the client's socket");
        assert_eq!(client_side.remote, addr);
        assert_eq!(state_name(client_side.state), "ESTAB");
        assert_eq!(
            Some(client_side.cookie),
            crate::socket_fds::socket_cookie(&client)
        );
        assert!(sockets
            .iter()
            .any(|s| s.is_listener() && s.local == addr && s.inode != 0));
        assert!(sockets
            .iter()
            .any(|s| s.local == addr && s.remote == accepted.peer_addr().expect("its peer")));
        assert!(listening(&here(), addr.port()).expect("sock_diag"));
    }
}
