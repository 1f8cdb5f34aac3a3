//! Which interface of a netns holds an IPv6 address, asked over rtnetlink (`RTM_GETADDR`, the
//! dump `ip -6 addr show` reads) on a socket already in the netns.

use std::io;
use std::net::Ipv6Addr;

use netlink_packet_core::{
    DecodeError, NetlinkDeserializable, NetlinkHeader, NetlinkSerializable, NlasIterator,
};
use netlink_sys::Socket;

use crate::netlink;

/// `RTM_NEWADDR` and `RTM_GETADDR` from `linux/rtnetlink.h`; `IFA_ADDRESS` from `linux/if_addr.h`.
pub(crate) const RTM_NEWADDR: u16 = 20;
const RTM_GETADDR: u16 = 22;
pub(crate) const IFA_ADDRESS: u16 = 1;
/// `ifaddrmsg`: family, prefix length, flags, scope, then the interface index.
pub(crate) const IFADDRMSG_LEN: usize = 8;

/// The index of the interface `address` is on in the socket's netns; `None` when no interface
/// has it.
///
/// # Errors
/// The kernel refused the dump or answered something unreadable.
pub(crate) fn interface_of(socket: &Socket, address: Ipv6Addr) -> io::Result<Option<u32>> {
    let mut found = None;
    netlink::dump(socket, GetAddresses, |answer: AddressAnswer| {
        if let Some((index, addr)) = answer.0 {
            if addr == address && found.is_none() {
                found = Some(index);
            }
        }
    })?;
    Ok(found)
}

/// The dump's request: every IPv6 address.
struct GetAddresses;

impl NetlinkSerializable for GetAddresses {
    fn message_type(&self) -> u16 {
        RTM_GETADDR
    }

    fn buffer_len(&self) -> usize {
        IFADDRMSG_LEN
    }

    fn serialize(&self, buffer: &mut [u8]) {
        buffer.fill(0);
        buffer[0] = libc::AF_INET6 as u8;
    }
}

/// One answer: an interface index and its IPv6 address, or nothing for another message.
#[derive(Debug)]
struct AddressAnswer(Option<(u32, Ipv6Addr)>);

impl NetlinkDeserializable for AddressAnswer {
    type Error = DecodeError;

    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> Result<Self, DecodeError> {
        if header.message_type != RTM_NEWADDR || payload.first() != Some(&(libc::AF_INET6 as u8)) {
            return Ok(Self(None));
        }
        let Some(index) = payload.get(4..IFADDRMSG_LEN) else {
            return Ok(Self(None));
        };
        let index = u32::from_ne_bytes(index.try_into().expect("four bytes"));
        for attribute in NlasIterator::new(&payload[IFADDRMSG_LEN..]) {
            let attribute = attribute?;
            if attribute.kind() == IFA_ADDRESS {
                if let Ok(octets) = <[u8; 16]>::try_from(attribute.value()) {
                    return Ok(Self(Some((index, Ipv6Addr::from(octets)))));
                }
            }
        }
        Ok(Self(None))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An `RTM_NEWADDR` payload as the kernel sends it: `ifaddrmsg` and `IFA_ADDRESS`.
    fn payload(index: u32, addr: Ipv6Addr) -> Vec<u8> {
        let mut bytes = vec![libc::AF_INET6 as u8, 64, 0, 0];
        bytes.extend_from_slice(&index.to_ne_bytes());
        bytes.extend_from_slice(&20u16.to_ne_bytes());
        bytes.extend_from_slice(&IFA_ADDRESS.to_ne_bytes());
        bytes.extend_from_slice(&addr.octets());
        bytes
    }

    fn header(message_type: u16) -> NetlinkHeader {
        let mut header = NetlinkHeader::default();
        header.message_type = message_type;
        header
    }

    #[test]
    fn an_address_answer_gives_its_interface_and_address() {
        let addr: Ipv6Addr = "fd00:1::10".parse().expect("an address");
        let got =
            AddressAnswer::deserialize(&header(RTM_NEWADDR), &payload(7, addr)).expect("readable");
        assert_eq!(got.0, Some((7, addr)));
    }

    #[test]
    fn other_messages_and_families_give_nothing() {
        let addr = Ipv6Addr::LOCALHOST;
        let other = AddressAnswer::deserialize(&header(RTM_GETADDR), &payload(1, addr));
        assert_eq!(other.expect("readable").0, None);
        let mut v4 = payload(1, addr);
        v4[0] = libc::AF_INET as u8;
        let v4 = AddressAnswer::deserialize(&header(RTM_NEWADDR), &v4);
        assert_eq!(v4.expect("readable").0, None);
    }

    #[test]
    fn the_request_asks_for_ipv6_addresses() {
        let mut buffer = vec![0xff; GetAddresses.buffer_len()];
        GetAddresses.serialize(&mut buffer);
        assert_eq!(GetAddresses.message_type(), RTM_GETADDR);
        assert_eq!(buffer, [libc::AF_INET6 as u8, 0, 0, 0, 0, 0, 0, 0]);
    }
}
