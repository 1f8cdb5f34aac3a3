//! A netlink dump asked in a netns: what `sockdiag` and `nf_tables` share. The socket answers
//! for the netns it was created in, so it is created on a thread that entered the netns and used
//! from the caller's.

use std::io;

use netlink_packet_core::{
    NetlinkDeserializable, NetlinkHeader, NetlinkMessage, NetlinkPayload, NetlinkSerializable,
    NLM_F_DUMP, NLM_F_REQUEST,
};
use netlink_sys::{Socket, SocketAddr as NetlinkAddr};

use crate::netns::{Netns, NetnsError};

/// A netlink socket of `protocol` (`netlink_sys::protocols`) in `netns`, connected to the kernel.
/// The outer error is entering the netns, the inner one the socket.
pub(crate) fn socket_in(netns: &Netns, protocol: isize) -> Result<io::Result<Socket>, NetnsError> {
    netns.run_in(|| {
        let mut socket = Socket::new(protocol)?;
        socket.bind_auto()?;
        socket.connect(&NetlinkAddr::new(0, 0))?;
        Ok(socket)
    })
}

/// Sends `request` as a dump and hands each answer to `each` until the kernel ends the dump.
pub(crate) fn dump<Q, A>(socket: &Socket, request: Q, mut each: impl FnMut(A)) -> io::Result<()>
where
    Q: NetlinkSerializable,
    A: NetlinkDeserializable,
{
    let mut header = NetlinkHeader::default();
    header.flags = NLM_F_REQUEST | NLM_F_DUMP;
    let mut message = NetlinkMessage::new(header, NetlinkPayload::InnerMessage(request));
    message.finalize();
    let mut bytes = vec![0; message.buffer_len()];
    message.serialize(&mut bytes);
    socket.send(&bytes, 0)?;
    // Each read returns whole messages; a dump's parts arrive over several reads.
    let mut buf = Vec::with_capacity(64 * 1024);
    loop {
        buf.clear();
        let size = socket.recv(&mut buf, 0)?;
        if read_answers(&buf[..size], &mut each)? == Read::Done {
            return Ok(());
        }
    }
}

/// Whether a dump goes on after one read.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Read {
    More,
    Done,
}

/// The messages of one read: answers go to `each`; the dump's end or an error ends it.
pub(crate) fn read_answers<A: NetlinkDeserializable>(
    bytes: &[u8],
    each: &mut impl FnMut(A),
) -> io::Result<Read> {
    let mut offset = 0;
    while offset < bytes.len() {
        let message = NetlinkMessage::<A>::deserialize(&bytes[offset..])
            .map_err(|e| io::Error::other(format!("an unreadable answer: {e}")))?;
        let length = message.header.length as usize;
        match message.payload {
            NetlinkPayload::InnerMessage(answer) => each(answer),
            NetlinkPayload::Done(_) => return Ok(Read::Done),
            NetlinkPayload::Error(e) => return Err(e.to_io()),
            _ => {}
        }
        if length == 0 {
            break;
        }
        offset += length;
    }
    Ok(Read::More)
}
