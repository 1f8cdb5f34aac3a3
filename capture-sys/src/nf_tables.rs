//! A netns's nftables tables, asked over nfnetlink (`NFT_MSG_GETTABLE`, the request `nft list
//! tables` sends) from this process. A CNI ADD looks for Istio's tables in every pod it
//! captures: a `nft` process per look cost each ADD milliseconds, where the request costs
//! microseconds.
//!
//! The netlink socket answers for the netns it was created in: it is created and read on a thread
//! that entered the pod's netns.

use std::io;

use netlink_packet_core::{
    parse_string, DecodeError, NetlinkDeserializable, NetlinkHeader, NetlinkSerializable,
    NlasIterator,
};
use netlink_sys::protocols::NETLINK_NETFILTER;

use crate::{
    netlink,
    netns::{Netns, NetnsError},
};

#[derive(Debug, thiserror::Error)]
pub enum NfTablesError {
    #[error(transparent)]
    Netns(#[from] NetnsError),
    #[error("asking the kernel for the nftables tables of netns {netns} (nfnetlink): {source}")]
    Netlink { netns: String, source: io::Error },
}

/// One table, named as `nft` names it: `family` is `ip`, `ip6`, `inet`, `arp`, `bridge` or
/// `netdev`.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Table {
    pub family: &'static str,
    pub name: String,
}

/// `NFNL_SUBSYS_NFTABLES` from `linux/netfilter/nfnetlink.h`.
const NFNL_SUBSYS_NFTABLES: u16 = 10;
/// `NFT_MSG_GETTABLE` from `linux/netfilter/nf_tables.h`.
const NFT_MSG_GETTABLE: u16 = 1;
/// `NFTA_TABLE_NAME`.
const NFTA_TABLE_NAME: u16 = 1;
/// `nfgenmsg`: family, version, resource id.
const NFGENMSG_LEN: usize = 4;

/// Every nftables table of `netns`, in every family. A kernel without `nf_tables` (nfnetlink not
/// there, or `nf_tables` not loadable) has none.
///
/// # Errors
/// The netns cannot be entered, or the kernel's answer cannot be read.
pub fn tables(netns: &Netns) -> Result<Vec<Table>, NfTablesError> {
    let failed = |source: io::Error| NfTablesError::Netlink {
        netns: netns.path().display().to_string(),
        source,
    };
    let socket = match netlink::socket_in(netns, NETLINK_NETFILTER)? {
        Ok(socket) => socket,
        // No nfnetlink in this kernel: no table can exist.
        Err(e) if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => return Ok(Vec::new()),
        Err(e) => return Err(failed(e)),
    };
    let mut found = Vec::new();
    match netlink::dump(&socket, GetTables, |TableAnswer(table)| {
        found.extend(table);
    }) {
        Ok(()) => Ok(found),
        // No `nf_tables` in the kernel, nor a module to load (nfnetlink answers EINVAL for a
        // subsystem it does not have): nothing of it exists.
        Err(e)
            if [libc::EINVAL, libc::ENOENT, libc::EOPNOTSUPP]
                .map(Some)
                .contains(&e.raw_os_error()) =>
        {
            Ok(Vec::new())
        }
        Err(e) => Err(failed(e)),
    }
}

/// The dump request: every family (`NFPROTO_UNSPEC`), nfnetlink version 0.
struct GetTables;

impl NetlinkSerializable for GetTables {
    fn message_type(&self) -> u16 {
        NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETTABLE
    }

    fn buffer_len(&self) -> usize {
        NFGENMSG_LEN
    }

    fn serialize(&self, buffer: &mut [u8]) {
        buffer.fill(0);
    }
}

/// One answer of the dump: a table, or nothing for a message this module does not read.
#[derive(Debug)]
struct TableAnswer(Option<Table>);

impl NetlinkDeserializable for TableAnswer {
    type Error = DecodeError;

    fn deserialize(header: &NetlinkHeader, payload: &[u8]) -> Result<Self, DecodeError> {
        if header.message_type >> 8 != NFNL_SUBSYS_NFTABLES {
            return Ok(Self(None));
        }
        let Some(family) = payload.first().copied().and_then(family_name) else {
            return Ok(Self(None));
        };
        for attribute in NlasIterator::new(payload.get(NFGENMSG_LEN..).unwrap_or_default()) {
            let attribute = attribute?;
            if attribute.kind() == NFTA_TABLE_NAME {
                let name = parse_string(attribute.value())?;
                return Ok(Self(Some(Table { family, name })));
            }
        }
        Ok(Self(None))
    }
}

/// `NFPROTO_*` from `linux/netfilter.h`, named as `nft` names them.
fn family_name(family: u8) -> Option<&'static str> {
    Some(match family {
        1 => "inet",
        2 => "ip",
        3 => "arp",
        5 => "netdev",
        7 => "bridge",
        10 => "ip6",
        _ => return None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::netlink::{read_answers, Read};

    const HEADER_LEN: usize = 16;
    const NLMSG_ERROR: u16 = 2;
    const NLMSG_DONE: u16 = 3;

    fn align(length: usize) -> usize {
        (length + 3) & !3
    }

    /// Each table of `bytes` into `found`.
    fn parse(bytes: &[u8], found: &mut Vec<Table>) -> io::Result<Read> {
        read_answers(bytes, &mut |TableAnswer(table)| found.extend(table))
    }

    fn message(kind: u16, body: &[u8]) -> Vec<u8> {
        let mut bytes = Vec::new();
        bytes.extend_from_slice(&((HEADER_LEN + body.len()) as u32).to_ne_bytes());
        bytes.extend_from_slice(&kind.to_ne_bytes());
        bytes.extend_from_slice(&[0; 10]);
        bytes.extend_from_slice(body);
        bytes.resize(align(bytes.len()), 0);
        bytes
    }

    fn table_message(family: u8, name: &str) -> Vec<u8> {
        let mut body = vec![family, 0, 0, 0];
        // A flags attribute first, so the name is not where a careless reader would look.
        body.extend_from_slice(&8u16.to_ne_bytes());
        body.extend_from_slice(&2u16.to_ne_bytes());
        body.extend_from_slice(&0u32.to_ne_bytes());
        let value_len = name.len() + 1;
        body.extend_from_slice(&((4 + value_len) as u16).to_ne_bytes());
        body.extend_from_slice(&(NFTA_TABLE_NAME | 0x8000).to_ne_bytes());
        body.extend_from_slice(name.as_bytes());
        body.push(0);
        body.resize(align(body.len()), 0);
        message(NFNL_SUBSYS_NFTABLES << 8, &body)
    }

    #[test]
    fn tables_of_each_family_are_read_until_the_dump_ends() {
        let mut bytes = table_message(2, "nat");
        bytes.extend(table_message(1, "istio-proxy-nat"));
        bytes.extend(table_message(10, "mangle"));
        let mut found = Vec::new();
        assert_eq!(parse(&bytes, &mut found).unwrap(), Read::More);
        assert_eq!(
            found,
            [
                ("ip", "nat"),
                ("inet", "istio-proxy-nat"),
                ("ip6", "mangle")
            ]
            .map(|(family, name)| Table {
                family,
                name: name.into()
            })
        );
        assert_eq!(
            parse(&message(NLMSG_DONE, &[0; 4]), &mut found).unwrap(),
            Read::Done
        );
    }

    #[test]
    fn an_error_ends_the_dump_with_its_errno_and_a_short_answer_is_refused() {
        let eperm = message(NLMSG_ERROR, &(-libc::EPERM).to_ne_bytes());
        let err = parse(&eperm, &mut Vec::new()).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::EPERM));
        let mut cut = table_message(2, "nat");
        cut.truncate(cut.len() - 8);
        assert!(parse(&cut, &mut Vec::new()).is_err());
    }
}
