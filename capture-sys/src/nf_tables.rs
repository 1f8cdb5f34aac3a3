//! A netns's nftables tables, asked over nfnetlink (`NFT_MSG_GETTABLE`, the request `nft list
//! tables` sends) from this process. A CNI ADD looks for Istio's tables in every pod it
//! captures: a `nft` process per look cost each ADD milliseconds, where the request costs
//! microseconds.
//!
//! The netlink socket answers for the netns it was created in: it is created and read on a thread
//! that entered the pod's netns.

use std::io;

use netlink_sys::{protocols::NETLINK_NETFILTER, Socket, SocketAddr as NetlinkAddr};

use crate::netns::{Netns, NetnsError};

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
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_ERROR: u16 = 2;
const NLMSG_DONE: u16 = 3;
/// `nlmsghdr`, then `nfgenmsg`.
const HEADER_LEN: usize = 16;
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
    netns.run_in(dump)?.map_err(failed)
}

fn dump() -> io::Result<Vec<Table>> {
    let mut socket = match Socket::new(NETLINK_NETFILTER) {
        Ok(socket) => socket,
        // No nfnetlink in this kernel: no table can exist.
        Err(e) if e.raw_os_error() == Some(libc::EPROTONOSUPPORT) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    socket.bind_auto()?;
    socket.connect(&NetlinkAddr::new(0, 0))?;
    socket.send(&request(), 0)?;
    let mut found = Vec::new();
    // Each read returns whole messages; a dump's parts arrive over several reads.
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        let size = socket.recv(&mut buf, 0)?;
        match parse(&buf[..size], &mut found)? {
            Parsed::Done => return Ok(found),
            Parsed::More => {}
        }
    }
}

/// The dump request: every family (`NFPROTO_UNSPEC`), nfnetlink version 0.
fn request() -> Vec<u8> {
    let length = (HEADER_LEN + NFGENMSG_LEN) as u32;
    let mut bytes = Vec::with_capacity(length as usize);
    bytes.extend_from_slice(&length.to_ne_bytes());
    bytes.extend_from_slice(&(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETTABLE).to_ne_bytes());
    bytes.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    bytes.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    bytes.extend_from_slice(&0u32.to_ne_bytes()); // port: the kernel's
    bytes.extend_from_slice(&[0, 0, 0, 0]); // family, version, resource id
    bytes
}

#[derive(Debug, PartialEq, Eq)]
enum Parsed {
    More,
    Done,
}

/// The messages of one read: tables go to `found`; the dump's end or an error ends it.
fn parse(mut bytes: &[u8], found: &mut Vec<Table>) -> io::Result<Parsed> {
    let short = || io::Error::other("a truncated answer");
    while bytes.len() >= HEADER_LEN {
        let length = u32::from_ne_bytes(bytes[0..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes(bytes[4..6].try_into().expect("2 bytes"));
        if length < HEADER_LEN || length > bytes.len() {
            return Err(short());
        }
        let body = &bytes[HEADER_LEN..length];
        match kind {
            NLMSG_DONE => return Ok(Parsed::Done),
            NLMSG_ERROR => {
                let code = body
                    .get(0..4)
                    .map(|b| i32::from_ne_bytes(b.try_into().expect("4 bytes")))
                    .ok_or_else(short)?;
                // No `nf_tables` in the kernel, nor a module to load (nfnetlink answers EINVAL for a
                // subsystem it does not have): nothing of it exists.
                if [libc::EINVAL, libc::ENOENT, libc::EOPNOTSUPP].contains(&-code) {
                    return Ok(Parsed::Done);
                }
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
            }
            _ if kind >> 8 == NFNL_SUBSYS_NFTABLES => {
                if let Some(table) = table(body) {
                    found.push(table);
                }
            }
            _ => {}
        }
        bytes = &bytes[align(length).min(bytes.len())..];
    }
    Ok(Parsed::More)
}

/// A table from one message's body (`nfgenmsg`, then attributes).
fn table(body: &[u8]) -> Option<Table> {
    let family = family_name(*body.first()?)?;
    let mut attrs = body.get(NFGENMSG_LEN..)?;
    while attrs.len() >= 4 {
        let length = usize::from(u16::from_ne_bytes(attrs[0..2].try_into().ok()?));
        // The nested and byte-order flags are not part of the type.
        let kind = u16::from_ne_bytes(attrs[2..4].try_into().ok()?) & 0x3fff;
        if length < 4 || length > attrs.len() {
            return None;
        }
        if kind == NFTA_TABLE_NAME {
            let value = &attrs[4..length];
            let name = value.split(|b| *b == 0).next()?;
            return Some(Table {
                family,
                name: String::from_utf8_lossy(name).into_owned(),
            });
        }
        attrs = &attrs[align(length).min(attrs.len())..];
    }
    None
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

/// Netlink's 4-byte alignment.
fn align(length: usize) -> usize {
    (length + 3) & !3
}

#[cfg(test)]
mod tests {
    use super::*;

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
        assert_eq!(parse(&bytes, &mut found).unwrap(), Parsed::More);
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
            Parsed::Done
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
