//! `capture-probe serve`: listeners that answer every TCP connection with a JSON line (the
//! listener's name, its local and peer address, `SO_ORIGINAL_DST`) and echo UDP datagrams, as a
//! pod's proxy and app would listen.

use std::{
    io::Write as _,
    net::{SocketAddr, TcpListener, UdpSocket},
    os::fd::AsRawFd as _,
};

use capture_tests::accepted::{serve_tcp, serve_udp};

use super::{check, die};

fn parse_named(spec: &str) -> (String, SocketAddr) {
    let (name, addr) = spec
        .split_once('=')
        .unwrap_or_else(|| die(format!("{spec}: want NAME=ADDR")));
    (
        name.to_string(),
        addr.parse().unwrap_or_else(|e| die(format!("{addr}: {e}"))),
    )
}

/// `IP_TRANSPARENT` (`IPV6_TRANSPARENT` for IPv6 sockets).
pub(super) fn set_transparent(fd: &std::os::fd::OwnedFd, ipv6: bool) {
    let on: libc::c_int = 1;
    let (level, opt) = if ipv6 {
        (libc::SOL_IPV6, libc::IPV6_TRANSPARENT)
    } else {
        (libc::SOL_IP, libc::IP_TRANSPARENT)
    };
    // SAFETY: an int option on an owned socket.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            opt,
            (&raw const on).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    check(rc, "IP_TRANSPARENT");
}

/// How `serve` opens its listeners.
#[derive(Clone, Copy, Default)]
pub(super) struct ServeOptions {
    pub(super) transparent: bool,
    pub(super) reuseport: bool,
    pub(super) dual_stack: bool,
}

thread_local! {
    static SERVE_OPTIONS: std::cell::Cell<ServeOptions> = std::cell::Cell::default();
}

/// A bound socket; IPv6 ones are v6-only (so that `0.0.0.0` and `[::]` can share a port) unless
/// `serve --dual-stack` asked otherwise.
fn bound(addr: SocketAddr, ty: nix::sys::socket::SockType) -> std::os::fd::OwnedFd {
    use nix::sys::socket::{
        bind, setsockopt, socket, sockopt, AddressFamily, SockFlag, SockaddrStorage,
    };
    let family = if addr.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let fd = socket(family, ty, SockFlag::SOCK_CLOEXEC, None).unwrap_or_else(|e| die(e));
    setsockopt(&fd, sockopt::ReuseAddr, &true).unwrap_or_else(|e| die(e));
    // The remote owns its addresses through local routes, not interface addresses; IPv6 binds
    // such an address only with freebind.
    setsockopt(&fd, sockopt::IpFreebind, &true).unwrap_or_else(|e| die(e));
    let options = SERVE_OPTIONS.with(std::cell::Cell::get);
    if options.transparent {
        set_transparent(&fd, addr.is_ipv6());
    }
    if options.reuseport {
        setsockopt(&fd, sockopt::ReusePort, &true).unwrap_or_else(|e| die(e));
    }
    if addr.is_ipv6() {
        setsockopt(&fd, sockopt::Ipv6V6Only, &!options.dual_stack).unwrap_or_else(|e| die(e));
    }
    bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))
        .unwrap_or_else(|e| die(format!("bind {addr}: {e}")));
    fd
}

fn bind_tcp(addr: SocketAddr) -> TcpListener {
    use nix::sys::socket::{listen, Backlog, SockType};
    let fd = bound(addr, SockType::Stream);
    listen(&fd, Backlog::new(128).expect("backlog")).unwrap_or_else(|e| die(e));
    TcpListener::from(fd)
}

pub(super) fn serve(tcp: &[String], udp: &[String], options: ServeOptions) -> ! {
    SERVE_OPTIONS.with(|o| o.set(options));
    let mut threads = Vec::new();
    for spec in tcp {
        let (name, addr) = parse_named(spec);
        let listener = bind_tcp(addr);
        threads.push(std::thread::spawn(move || serve_tcp(name, listener)));
    }
    for spec in udp {
        let (name, addr) = parse_named(spec);
        let socket = UdpSocket::from(bound(addr, nix::sys::socket::SockType::Datagram));
        threads.push(std::thread::spawn(move || serve_udp(name, socket)));
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    for t in threads {
        let _ = t.join();
    }
    std::process::exit(0)
}
