//! An IPv6 address on a netns's `lo`, added and taken off over rtnetlink from this process: the
//! requests `ip -6 addr add|del ADDR/128 dev lo nodad` send. Every ADD of a pod with an IPv6
//! address adds one (`add_inbound_passthrough_v6`); two `ip` processes per ADD cost
//! milliseconds, where the request costs microseconds.
//!
//! The netlink socket answers for the netns it was created in: it is created on a thread that
//! entered the pod's netns.

use std::{io, net::Ipv6Addr};

use netlink_sys::{protocols::NETLINK_ROUTE, Socket};

use crate::{
    netlink,
    netns::{Netns, NetnsError},
};

/// `RTM_NEWADDR` and `RTM_DELADDR` from `linux/rtnetlink.h`.
const RTM_NEWADDR: u16 = 20;
const RTM_DELADDR: u16 = 21;
/// `IFA_ADDRESS`, `IFA_LOCAL` and `IFA_FLAGS` from `linux/if_addr.h`.
const IFA_ADDRESS: u16 = 1;
const IFA_LOCAL: u16 = 2;
const IFA_FLAGS: u16 = 8;
/// `IFA_F_NODAD`: the address is usable at once, as `ip ... nodad` asks (a tentative address
/// cannot be bound).
const IFA_F_NODAD: u8 = 0x02;
/// `LOOPBACK_IFINDEX`: `lo` is interface 1 in every netns.
const LO_INDEX: u32 = 1;
/// `nlmsghdr` and `ifaddrmsg`.
const HEADER_LEN: usize = 16;
const IFADDRMSG_LEN: usize = 8;
/// `NLMSG_ERROR`, the kernel's answer to a request that asked for an acknowledgement.
const NLMSG_ERROR: u16 = 2;

/// Istio's IPv6 inbound-passthrough source, `127.0.0.6`'s IPv6 twin.
const INBOUND_PASSTHROUGH_V6: Ipv6Addr = Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6);

/// Adds `::6/128` to the netns's `lo`, as Istio does for pods with an IPv6 address: the
/// inbound-passthrough source must be a local address to bind. Returns whether it was added
/// (false: `lo` had it already).
pub fn add_inbound_passthrough_v6(netns: &Netns) -> Result<bool, NetnsError> {
    add_v6(netns, INBOUND_PASSTHROUGH_V6)
}

/// Takes `::6/128` off the netns's `lo` again (an attach that added it failed later).
pub fn remove_inbound_passthrough_v6(netns: &Netns) -> Result<(), NetnsError> {
    remove_v6(netns, INBOUND_PASSTHROUGH_V6)
}

/// What was asked: add `addr` to the netns's `lo` (`true`), or `lo` had it already (`false`).
///
/// # Errors
/// The netns cannot be entered, or the kernel refused the address.
pub fn add_v6(netns: &Netns, addr: Ipv6Addr) -> Result<bool, NetnsError> {
    let flags = libc::NLM_F_CREATE | libc::NLM_F_EXCL;
    match ask(netns, RTM_NEWADDR, flags as u16, addr) {
        Ok(()) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::EEXIST) => Ok(false),
        Err(e) => Err(failed(netns, &format!("adding {addr}/128 to lo"), e)),
    }
}

/// Takes `addr` off the netns's `lo`.
///
/// # Errors
/// The netns cannot be entered, or the kernel refused (`lo` does not have the address, say).
pub fn remove_v6(netns: &Netns, addr: Ipv6Addr) -> Result<(), NetnsError> {
    ask(netns, RTM_DELADDR, 0, addr)
        .map_err(|e| failed(netns, &format!("removing {addr}/128 from lo"), e))
}

fn failed(netns: &Netns, what: &str, reason: io::Error) -> NetnsError {
    NetnsError::Open {
        path: netns.path().into(),
        source: io::Error::new(reason.kind(), format!("{what}: {reason}")),
    }
}

/// Sends one address request about `addr` on `lo` in `netns` and reads the kernel's answer.
fn ask(netns: &Netns, kind: u16, flags: u16, addr: Ipv6Addr) -> io::Result<()> {
    let socket = netlink::socket_in(netns, NETLINK_ROUTE).map_err(io::Error::other)??;
    socket.send(&request(kind, flags, addr), 0)?;
    acknowledged(&socket)
}

/// The request's bytes: `nlmsghdr`, `ifaddrmsg` (IPv6, /128, `nodad`, `lo`) and the address as
/// both `IFA_LOCAL` and `IFA_ADDRESS`, as `ip` sends it.
fn request(kind: u16, flags: u16, addr: Ipv6Addr) -> Vec<u8> {
    // The message, two address attributes and the flags.
    let mut body = Vec::with_capacity(IFADDRMSG_LEN + 2 * 20 + 8);
    body.extend_from_slice(&[libc::AF_INET6 as u8, 128, IFA_F_NODAD, 0]);
    body.extend_from_slice(&LO_INDEX.to_ne_bytes());
    for kind in [IFA_LOCAL, IFA_ADDRESS] {
        attribute(&mut body, kind, &addr.octets());
    }
    attribute(&mut body, IFA_FLAGS, &u32::from(IFA_F_NODAD).to_ne_bytes());
    let flags = flags | (libc::NLM_F_REQUEST | libc::NLM_F_ACK) as u16;
    let length = u32::try_from(HEADER_LEN + body.len()).expect("a short message");
    let mut message = Vec::with_capacity(HEADER_LEN + body.len());
    message.extend_from_slice(&length.to_ne_bytes());
    message.extend_from_slice(&kind.to_ne_bytes());
    message.extend_from_slice(&flags.to_ne_bytes());
    // Sequence number and port: one request per socket, the kernel fills the port.
    message.extend_from_slice(&[0; 8]);
    message.extend_from_slice(&body);
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
        let bytes = request(RTM_NEWADDR, 0, addr);
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
    fn the_kernels_answer_is_an_acknowledgement_or_its_errno() {
        assert!(answer(&ack(0)).is_ok());
        let refused = answer(&ack(-libc::EEXIST)).unwrap_err();
        assert_eq!(refused.raw_os_error(), Some(libc::EEXIST));
        assert!(answer(&ack(0)[..10]).is_err(), "a short answer is refused");
    }
}
