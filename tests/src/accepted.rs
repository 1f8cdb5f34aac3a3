//! What the probe's servers answer: each accepted connection's addresses, original destination
//! and another option of its socket, as JSON; and the names of the errors clients see.

use std::{
    io::{BufRead as _, BufReader, Write as _},
    net::{TcpListener, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
};

use serde_json::{json, Value};

pub fn errno_name(e: &std::io::Error) -> String {
    match e.raw_os_error() {
        Some(libc::ECONNREFUSED) => "ECONNREFUSED".into(),
        Some(libc::EPERM) => "EPERM".into(),
        // A blocking connect that hits SO_SNDTIMEO reports EINPROGRESS.
        Some(libc::ETIMEDOUT | libc::EAGAIN | libc::EINPROGRESS) => "ETIMEDOUT".into(),
        Some(libc::ENETUNREACH) => "ENETUNREACH".into(),
        _ if e.kind() == std::io::ErrorKind::TimedOut
            || e.kind() == std::io::ErrorKind::WouldBlock =>
        {
            "ETIMEDOUT".into()
        }
        _ => e.to_string(),
    }
}

/// `SO_ORIGINAL_DST` (IPv4) or `IP6T_SO_ORIGINAL_DST` (IPv6) of an accepted socket.
fn original_dst(stream: &TcpStream, ipv6: bool) -> Value {
    match crate::flood::original_dst(stream.as_raw_fd(), ipv6) {
        Ok(addr) => json!(addr.to_string()),
        Err(e) => json!({ "error": errno_name(&e) }),
    }
}

/// `IPV6_UNICAST_HOPS` of a socket.
fn stream_hops(stream: &TcpStream) -> Option<u32> {
    let mut v: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: `v` is an int-sized out-buffer.
    let rc = unsafe {
        libc::getsockopt(
            stream.as_raw_fd(),
            libc::SOL_IPV6,
            libc::IPV6_UNICAST_HOPS,
            (&raw mut v).cast(),
            &raw mut len,
        )
    };
    (rc == 0).then_some(v as u32)
}

/// What the server sees of an accepted connection, asked afresh each time.
fn describe(name: &str, stream: &TcpStream) -> Value {
    let local = stream.local_addr().ok();
    let ipv6 = local.is_some_and(|a| {
        a.is_ipv6() && !matches!(a.ip(), std::net::IpAddr::V6(v) if v.to_ipv4_mapped().is_some())
    });
    json!({
        "server": name,
        "local": local.map(|a| a.to_string()),
        "peer": stream.peer_addr().ok().map(|a| a.to_string()),
        "orig": original_dst(stream, ipv6),
        // Another SOL_IP/SOL_IPV6 option, to show capture leaves other getsockopt calls alone.
        "ttl": if ipv6 { stream_hops(stream) } else { stream.ttl().ok() },
    })
}

/// Answers each connection with what it sees of it, and again for every line the client sends
/// (a held connection asks again later), until the client closes.
pub fn serve_tcp(name: String, listener: TcpListener) {
    for stream in listener.incoming() {
        let Ok(mut stream) = stream else { continue };
        let name = name.clone();
        std::thread::spawn(move || {
            let _ = writeln!(stream, "{}", describe(&name, &stream));
            let Ok(reader) = stream.try_clone() else {
                return;
            };
            for line in BufReader::new(reader).lines() {
                if line.is_err() {
                    break;
                }
                let _ = writeln!(stream, "{}", describe(&name, &stream));
            }
        });
    }
}

pub fn serve_udp(name: String, socket: UdpSocket) {
    let mut buf = [0u8; 1500];
    while let Ok((n, from)) = socket.recv_from(&mut buf) {
        let reply = json!({
            "server": name,
            "local": socket.local_addr().ok().map(|a| a.to_string()),
            "peer": from.to_string(),
            "echo": String::from_utf8_lossy(&buf[..n]),
        });
        let _ = socket.send_to(reply.to_string().as_bytes(), from);
    }
}
