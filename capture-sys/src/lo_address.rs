//! What an IPv6 pod's netns gets, over rtnetlink from this process: the address `::6/128` on
//! `lo` (the request `ip -6 addr add ::6/128 dev lo nodad` sends) and, for the ebpf backend, the
//! route `local 100::/64 dev lo table local` (the IPv6 stateless redirect) and a route of `::1`
//! on the interface of the pod's address (the stateful redirect's replies). Every ADD of a pod
//! with an IPv6 address adds them; `ip` processes per ADD cost milliseconds, where the requests
//! cost microseconds.
//!
//! The netlink socket answers for the netns it was created in: it is created on a thread that
//! entered the pod's netns, and one socket carries every request of a call.

use std::{io, net::Ipv6Addr};

use netlink_sys::{protocols::NETLINK_ROUTE, Socket};

use crate::{
    if_address::{IFADDRMSG_LEN, IFA_ADDRESS, RTM_NEWADDR},
    netlink,
    netns::{Netns, NetnsError},
};

/// `RTM_DELADDR`, `RTM_NEWROUTE` and `RTM_DELROUTE` from `linux/rtnetlink.h` (`RTM_NEWADDR`,
/// `IFA_ADDRESS` and `ifaddrmsg`'s length are `if_address`'s).
const RTM_DELADDR: u16 = 21;
const RTM_NEWROUTE: u16 = 24;
const RTM_DELROUTE: u16 = 25;
/// `IFA_LOCAL` and `IFA_FLAGS` from `linux/if_addr.h`.
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
/// `IFA_F_NODAD`: the address is usable at once, as `ip ... nodad` asks (a tentative address
/// cannot be bound).
const IFA_F_NODAD: u8 = 0x02;
/// `RTA_DST`, `RTA_OIF` and `RTA_PREFSRC`; `RT_TABLE_LOCAL`, `RTPROT_BOOT` (what `ip route add` sends),
/// `RT_SCOPE_HOST` and `RTN_LOCAL` from `linux/rtnetlink.h`.
const RTA_DST: u16 = 1;
const RTA_OIF: u16 = 4;
const RTA_PREFSRC: u16 = 7;
const RT_TABLE_LOCAL: u8 = 255;
const RTPROT_BOOT: u8 = 3;
const RT_SCOPE_HOST: u8 = 254;
const RTN_LOCAL: u8 = 2;
/// `LOOPBACK_IFINDEX`: `lo` is interface 1 in every netns.
const LO_INDEX: u32 = 1;
/// `nlmsghdr`, `ifaddrmsg` and `rtmsg`.
const HEADER_LEN: usize = 16;
const RTMSG_LEN: usize = 12;
/// A request that creates what is not there yet (`EEXIST` when it is).
const CREATE_NEW: u16 = (libc::NLM_F_CREATE | libc::NLM_F_EXCL) as u16;
/// `NLMSG_ERROR`, the kernel's answer to a request that asked for an acknowledgement.
const NLMSG_ERROR: u16 = 2;

/// Istio's IPv6 inbound-passthrough source, `127.0.0.6`'s IPv6 twin.
const INBOUND_PASSTHROUGH_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);
/// The prefix the IPv6 stateless redirect sends connections to (`capture_common::loopback`):
/// RFC 6666's discard-only prefix, which no real destination is in.
pub const STATELESS_PREFIX_V6: Ipv6Addr = Ipv6Addr::new(0x100, 0, 0, 0, 0, 0, 0, 0);
const STATELESS_PREFIX_LEN: u8 = 64;

/// What `prepare_ipv6_pod` added (`false`, `None`: the netns had it already, or it was not
/// asked for), and so what a failed attach takes off again.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct LoAdded {
    pub passthrough: bool,
    pub stateless_route: bool,
    /// The interface given a route of `::1`.
    pub loopback_reply_route: Option<u32>,
}

/// Adds `::6/128` to the netns's `lo`, as Istio does for pods with an IPv6 address (the
/// inbound-passthrough source must be a local address to bind), and with `ebpf_routes` the
/// local route of `100::/64` on `lo` and the loopback reply route (`loopback_reply_route_body`)
/// on the interface that holds `pod_address`. Any of them already there is no error.
///
/// # Errors
/// The netns cannot be entered, or the kernel refused a request.
pub fn prepare_ipv6_pod(
    netns: &Netns,
    pod_address: Ipv6Addr,
    ebpf_routes: bool,
) -> Result<LoAdded, NetnsError> {
    let socket = open(netns)?;
    let passthrough = added(
        ask(
            &socket,
            RTM_NEWADDR,
            CREATE_NEW,
            address(INBOUND_PASSTHROUGH_V6),
        ),
        netns,
        &format!("adding {INBOUND_PASSTHROUGH_V6}/128 to lo"),
    )?;
    let mut done = LoAdded {
        passthrough,
        ..LoAdded::default()
    };
    if ebpf_routes {
        if let Err(e) = add_ebpf_routes(netns, &socket, pod_address, &mut done) {
            // Nothing half done: what was added goes again.
            let _ = undo(netns, &socket, done);
            return Err(e);
        }
    }
    Ok(done)
}

fn add_ebpf_routes(
    netns: &Netns,
    socket: &Socket,
    pod_address: Ipv6Addr,
    done: &mut LoAdded,
) -> Result<(), NetnsError> {
    done.stateless_route = added(
        ask(socket, RTM_NEWROUTE, CREATE_NEW, stateless_route_body()),
        netns,
        &format!("adding the route local {STATELESS_PREFIX_V6}/{STATELESS_PREFIX_LEN} dev lo"),
    )?;
    let interface = crate::if_address::interface_of(socket, pod_address)
        .map_err(|e| failed(netns, &format!("finding the interface of {pod_address}"), e))?;
    // An address on `lo`, or on no interface (nothing binds it then), needs no route.
    let Some(index) = interface.filter(|&index| index != LO_INDEX) else {
        return Ok(());
    };
    let asked = ask(
        socket,
        RTM_NEWROUTE,
        CREATE_NEW,
        loopback_reply_route_body(index),
    );
    // The kernel refuses a route through an interface that is down. The runtime's network plugin
    // brings the pod's interface up before capture; a pod without it has no network for its
    // proxy to reach, and is captured as before, without the route, and said so.
    if asked
        .as_ref()
        .is_err_and(|e| e.raw_os_error() == Some(libc::ENETDOWN))
    {
        tracing::warn!(
            interface = index,
            address = %pod_address,
            "the interface of the pod's IPv6 address is down: no route of ::1 on it"
        );
        return Ok(());
    }
    let route = added(
        asked,
        netns,
        &format!("adding the route local ::1 on interface {index}, the one of {pod_address}"),
    )?;
    done.loopback_reply_route = route.then_some(index);
    Ok(())
}

/// Takes off what `prepare_ipv6_pod` added (an attach that added it failed later).
///
/// # Errors
/// The netns cannot be entered, or the kernel refused a request.
pub fn undo_ipv6_pod(netns: &Netns, added: LoAdded) -> Result<(), NetnsError> {
    if added == LoAdded::default() {
        return Ok(());
    }
    undo(netns, &open(netns)?, added)
}

fn undo(netns: &Netns, socket: &Socket, added: LoAdded) -> Result<(), NetnsError> {
    if let Some(index) = added.loopback_reply_route {
        ask(socket, RTM_DELROUTE, 0, loopback_reply_route_body(index)).map_err(|e| {
            failed(
                netns,
                &format!("removing the route of ::1 from interface {index}"),
                e,
            )
        })?;
    }
    if added.stateless_route {
        ask(socket, RTM_DELROUTE, 0, stateless_route_body())
            .map_err(|e| failed(netns, "removing the route of 100::/64 from lo", e))?;
    }
    if added.passthrough {
        ask(socket, RTM_DELADDR, 0, address(INBOUND_PASSTHROUGH_V6)).map_err(|e| {
            failed(
                netns,
                &format!("removing {INBOUND_PASSTHROUGH_V6}/128 from lo"),
                e,
            )
        })?;
    }
    Ok(())
}

/// Whether a create request added something (`false`: it was there).
fn added(asked: io::Result<()>, netns: &Netns, what: &str) -> Result<bool, NetnsError> {
    match asked {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(failed(netns, what, e)),
    }
}

fn failed(netns: &Netns, what: &str, reason: io::Error) -> NetnsError {
    NetnsError::Open {
        path: netns.path().into(),
        source: io::Error::new(reason.kind(), format!("{what}: {reason}")),
    }
}

fn open(netns: &Netns) -> Result<Socket, NetnsError> {
    netlink::socket_in(netns, NETLINK_ROUTE)?
        .map_err(|e| failed(netns, "opening a netlink socket", e))
}

/// Sends one request and reads the kernel's answer.
fn ask(socket: &Socket, kind: u16, flags: u16, body: Vec<u8>) -> io::Result<()> {
    socket.send(&message(kind, flags, &body), 0)?;
    acknowledged(socket)
}

/// An address request's body: `ifaddrmsg` (IPv6, /128, `nodad`, `lo`) and the address as both
/// `IFA_LOCAL` and `IFA_ADDRESS`, as `ip` sends it.
fn address(addr: Ipv6Addr) -> Vec<u8> {
    let mut body = Vec::with_capacity(IFADDRMSG_LEN + 2 * 20 + 8);
    body.extend_from_slice(&[libc::AF_INET6 as u8, 128, IFA_F_NODAD, 0]);
    body.extend_from_slice(&LO_INDEX.to_ne_bytes());
    for kind in [IFA_LOCAL, IFA_ADDRESS] {
        attribute(&mut body, kind, &addr.octets());
    }
    attribute(&mut body, IFA_FLAGS, &u32::from(IFA_F_NODAD).to_ne_bytes());
    body
}

/// The stateless route's body, as `ip -6 route add local 100::/64 dev lo table local src ::1`
/// sends it. The source is what the redirect needs: a loopback end, which `tcp_tw_reuse=2` reuses
/// ports for, and which getsockname6 maps to the pod's address; without it the kernel would pick
/// `::6`, and choosing it costs the connect an address walk.
fn stateless_route_body() -> Vec<u8> {
    local_route_body(
        (STATELESS_PREFIX_V6, STATELESS_PREFIX_LEN),
        LO_INDEX,
        Some(Ipv6Addr::LOCALHOST),
    )
}

/// The loopback reply route's body, as `ip -6 route add local ::1 dev IF table local` sends it
/// (metric 1024, the kernel's default, behind `lo`'s own route of `::1` at 0, which every other
/// lookup keeps finding). The stateful redirect binds the pod's address and connects to `[::1]`;
/// once the app's socket is a time-wait socket, the kernel routes its answers (the ACK of the
/// proxy's late FIN, a reset) to a loopback destination strictly through the interface the packet
/// they answer came in on (`tcp_v6_send_response`), which for the pod's address is the address's
/// own interface, where `::1` had no route: the answer was dropped, the proxy's end waited in
/// `LAST-ACK`, and a connect reusing its port in `SYN-SENT`. Packets that come in on that
/// interface for `::1` are still dropped before routing (`ip6_rcv_core`).
fn loopback_reply_route_body(interface: u32) -> Vec<u8> {
    local_route_body((Ipv6Addr::LOCALHOST, 128), interface, None)
}

/// A local route's body: `rtmsg` (IPv6, the prefix length, table local, scope host, type local),
/// the prefix, the interface and the preferred source if any.
fn local_route_body(
    (prefix, len): (Ipv6Addr, u8),
    interface: u32,
    source: Option<Ipv6Addr>,
) -> Vec<u8> {
    let mut body = Vec::with_capacity(RTMSG_LEN + 20 + 8 + 20);
    body.extend_from_slice(&[
        libc::AF_INET6 as u8,
        len,
        0,
        0,
        RT_TABLE_LOCAL,
        RTPROT_BOOT,
        RT_SCOPE_HOST,
        RTN_LOCAL,
    ]);
    body.extend_from_slice(&0u32.to_ne_bytes());
    attribute(&mut body, RTA_DST, &prefix.octets());
    attribute(&mut body, RTA_OIF, &interface.to_ne_bytes());
    if let Some(source) = source {
        attribute(&mut body, RTA_PREFSRC, &source.octets());
    }
    body
}

/// `nlmsghdr` and `body`, asking for an acknowledgement.
fn message(kind: u16, flags: u16, body: &[u8]) -> Vec<u8> {
    let flags = flags | (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    let length = u32::try_from(HEADER_LEN + body.len()).expect("a short message");
    let mut message = Vec::with_capacity(HEADER_LEN + body.len());
    message.extend_from_slice(&length.to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(&flags.to_ne_bytes());
    // Sequence number and port: the kernel fills the port, and answers come in order.
    message.extend_from_slice(&[0; 8]);
    message.extend_from_slice(body);
    message
}

/// Appends a netlink attribute, padded to four bytes.
fn attribute(out: &mut Vec<u8>, kind: u16, value: &[u8]) {
    let length = u16::try_from(4 + value.len()).expect("a short attribute");
    out.extend_from_slice(&length.to_ne_bytes());
    out.extend_from_slice(&kind.to_ne_bytes());
    out.extend_from_slice(value);
    out.resize(out.len().next_multiple_of(4), 0);
}

/// Reads the kernel's acknowledgement: `NLMSG_ERROR` with 0, or the errno it refused with.
fn acknowledged(socket: &Socket) -> io::Result<()> {
    let mut buf = Vec::with_capacity(4096);
    let size = socket.recv(&mut buf, 0)?;
    answer(&buf[..size])
}

fn answer(bytes: &[u8]) -> io::Result<()> {
    let unreadable = || io::Error::other(format!("an unreadable answer of {} bytes", bytes.len()));
    let field = |at: usize, len: usize| bytes.get(at..at + len).ok_or_else(unreadable);
    let kind = u16::from_ne_bytes(field(4, 2)?.try_into().expect("two bytes"));
    if kind != NLMSG_ERROR {
        return Err(unreadable());
    }
    match i32::from_ne_bytes(field(HEADER_LEN, 4)?.try_into().expect("four bytes")) {
        0 => Ok(()),
        errno => Err(io::Error::from_raw_os_error(-errno)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ack(errno: i32) -> Vec<u8> {
        let mut bytes = vec![0; HEADER_LEN];
        bytes[4..6].copy_from_slice(&NLMSG_ERROR.to_ne_bytes());
        bytes.extend_from_slice(&errno.to_ne_bytes());
        bytes
    }

    #[test]
    fn the_request_is_ips_ifaddrmsg_and_attributes() {
        let addr: Ipv6Addr = "::6".parse().unwrap();
        let bytes = message(RTM_NEWADDR, 0, &address(addr));
        assert_eq!(bytes.len(), HEADER_LEN + IFADDRMSG_LEN + 20 + 20 + 8);
        assert_eq!(
            u32::from_ne_bytes(bytes[..4].try_into().unwrap()) as usize,
            bytes.len()
        );
        assert_eq!(
            &bytes[HEADER_LEN..HEADER_LEN + 4],
            &[10, 128, IFA_F_NODAD, 0]
        );
        let local = HEADER_LEN + IFADDRMSG_LEN;
        assert_eq!(&bytes[local + 4..local + 20], &addr.octets());
    }

    #[test]
    fn the_route_request_is_ips_rtmsg_prefix_and_lo() {
        let bytes = message(RTM_NEWROUTE, 0, &stateless_route_body());
        assert_eq!(bytes.len(), HEADER_LEN + RTMSG_LEN + 20 + 8 + 20);
        assert_eq!(
            &bytes[HEADER_LEN..HEADER_LEN + 8],
            &[10, 64, 0, 0, 255, 3, 254, 2]
        );
        let dst = HEADER_LEN + RTMSG_LEN;
        assert_eq!(&bytes[dst + 2..dst + 4], &RTA_DST.to_ne_bytes());
        assert_eq!(
            &bytes[dst + 4..dst + 20],
            &"100::".parse::<Ipv6Addr>().unwrap().octets()
        );
        assert_eq!(&bytes[dst + 24..dst + 28], &1u32.to_ne_bytes(), "lo");
        assert_eq!(&bytes[dst + 30..dst + 32], &RTA_PREFSRC.to_ne_bytes());
        assert_eq!(&bytes[dst + 32..dst + 48], &Ipv6Addr::LOCALHOST.octets());
    }

    #[test]
    fn the_loopback_reply_route_is_local_ipv6_loopback_on_the_interface() {
        let bytes = message(RTM_NEWROUTE, 0, &loopback_reply_route_body(7));
        assert_eq!(bytes.len(), HEADER_LEN + RTMSG_LEN + 20 + 8);
        // No metric: the kernel's default (1024), behind lo's own route of ::1.
        assert_eq!(
            &bytes[HEADER_LEN..HEADER_LEN + 8],
            &[10, 128, 0, 0, 255, 3, 254, 2]
        );
        let dst = HEADER_LEN + RTMSG_LEN;
        assert_eq!(&bytes[dst + 2..dst + 4], &RTA_DST.to_ne_bytes());
        assert_eq!(&bytes[dst + 4..dst + 20], &Ipv6Addr::LOCALHOST.octets());
        assert_eq!(&bytes[dst + 22..dst + 24], &RTA_OIF.to_ne_bytes());
        assert_eq!(&bytes[dst + 24..dst + 28], &7u32.to_ne_bytes());
    }

    #[test]
    fn the_kernels_answer_is_an_acknowledgement_or_its_errno() {
        assert!(answer(&ack(0)).is_ok());
        let refused = answer(&ack(-libc::EEXIST)).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::EEXIST));
        assert!(answer(&ack(0)[..10]).is_err(), "a short answer is refused");
    }
}
