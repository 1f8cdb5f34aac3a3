//! A survey of getsockopt answers, for comparing a captured process's with an uncaptured one's:
//! options at every level capture's getsockopt program sees (socket, IP, IPv6, TCP, Unix), with
//! buffers shorter than, equal to and longer than a page, and one answer longer than a page
//! (`SO_PEERGROUPS` of a peer with many supplementary groups). Every answer is given as its result,
//! length and bytes; values that differ from socket to socket (a peer's pid) are left out.

use std::os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd};

use serde_json::{json, Map, Value};

/// How many supplementary groups the Unix socket's peer has: 1,100 gids are 4,400 bytes.
pub const PEER_GROUPS: u32 = 1100;

/// A page, as the kernel hands a cgroup getsockopt program at most one.
const PAGE: usize = 4096;

fn socket(domain: i32, ty: i32) -> OwnedFd {
    // SAFETY: plain socket(2); the result is checked before it is owned.
    let fd = unsafe { libc::socket(domain, ty | libc::SOCK_CLOEXEC, 0) };
    assert!(fd >= 0, "socket: {}", std::io::Error::last_os_error());
    // SAFETY: a fresh descriptor nothing else owns.
    unsafe { OwnedFd::from_raw_fd(fd) }
}

fn set_int(fd: &OwnedFd, level: i32, name: i32, value: i32) {
    crate::flood::set_int(fd, level, name, value).expect("setsockopt");
}

/// One getsockopt with a buffer of `len` bytes: what it returned, as JSON.
fn get(fd: &OwnedFd, level: i32, name: i32, len: usize) -> Value {
    let mut buf = vec![0u8; len];
    let mut optlen = len as libc::socklen_t;
    // SAFETY: the buffer holds `optlen` bytes and both outlive the call.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            level,
            name,
            buf.as_mut_ptr().cast(),
            &raw mut optlen,
        )
    };
    if rc != 0 {
        let e = std::io::Error::last_os_error();
        return json!({"ok": false, "errno": e.raw_os_error()});
    }
    let shown = (optlen as usize).min(len);
    let hex: String = buf[..shown].iter().map(|b| format!("{b:02x}")).collect();
    json!({"ok": true, "len": optlen, "bytes": hex})
}

/// Every answer, keyed by a name that says what was asked.
#[must_use]
pub fn survey() -> Value {
    let mut answers = Map::new();
    let mut ask = |what: &str, fd: &OwnedFd, level: i32, name: i32, len: usize| {
        answers.insert(what.to_string(), get(fd, level, name, len));
    };

    let tcp = socket(libc::AF_INET, libc::SOCK_STREAM);
    set_int(&tcp, libc::SOL_SOCKET, libc::SO_RCVBUF, 65536);
    set_int(&tcp, libc::SOL_IP, libc::IP_TOS, 0x10);
    set_int(&tcp, libc::SOL_TCP, libc::TCP_NODELAY, 1);
    for (what, level, name) in [
        ("SO_TYPE", libc::SOL_SOCKET, libc::SO_TYPE),
        ("SO_DOMAIN", libc::SOL_SOCKET, libc::SO_DOMAIN),
        ("SO_PROTOCOL", libc::SOL_SOCKET, libc::SO_PROTOCOL),
        ("SO_RCVBUF", libc::SOL_SOCKET, libc::SO_RCVBUF),
        ("SO_KEEPALIVE", libc::SOL_SOCKET, libc::SO_KEEPALIVE),
        ("SO_LINGER", libc::SOL_SOCKET, libc::SO_LINGER),
        ("SO_ERROR", libc::SOL_SOCKET, libc::SO_ERROR),
        ("SO_ACCEPTCONN", libc::SOL_SOCKET, libc::SO_ACCEPTCONN),
        ("SO_BINDTODEVICE", libc::SOL_SOCKET, libc::SO_BINDTODEVICE),
        ("IP_TTL", libc::SOL_IP, libc::IP_TTL),
        ("IP_TOS", libc::SOL_IP, libc::IP_TOS),
        ("IP_OPTIONS", libc::SOL_IP, libc::IP_OPTIONS),
        ("IP_MTU_DISCOVER", libc::SOL_IP, libc::IP_MTU_DISCOVER),
        // Not redirected: the kernel's own answer (no conntrack entry).
        ("SO_ORIGINAL_DST", libc::SOL_IP, 80),
        ("SOL_IP unknown", libc::SOL_IP, 9999),
        ("TCP_NODELAY", libc::SOL_TCP, libc::TCP_NODELAY),
        ("TCP_MAXSEG", libc::SOL_TCP, libc::TCP_MAXSEG),
        ("TCP_CONGESTION", libc::SOL_TCP, libc::TCP_CONGESTION),
        ("TCP_KEEPIDLE", libc::SOL_TCP, libc::TCP_KEEPIDLE),
        ("TCP_USER_TIMEOUT", libc::SOL_TCP, libc::TCP_USER_TIMEOUT),
    ] {
        ask(what, &tcp, level, name, 64);
    }
    // Buffers shorter than the answer, exactly a page, and longer than a page.
    ask("SO_TYPE short", &tcp, libc::SOL_SOCKET, libc::SO_TYPE, 2);
    ask("SO_TYPE empty", &tcp, libc::SOL_SOCKET, libc::SO_TYPE, 0);
    ask(
        "TCP_CONGESTION page",
        &tcp,
        libc::SOL_TCP,
        libc::TCP_CONGESTION,
        PAGE,
    );
    ask(
        "TCP_CONGESTION pages",
        &tcp,
        libc::SOL_TCP,
        libc::TCP_CONGESTION,
        3 * PAGE,
    );

    let tcp6 = socket(libc::AF_INET6, libc::SOCK_STREAM);
    for (what, level, name) in [
        ("IPV6_V6ONLY", libc::SOL_IPV6, libc::IPV6_V6ONLY),
        ("IPV6_UNICAST_HOPS", libc::SOL_IPV6, libc::IPV6_UNICAST_HOPS),
        ("IP6T_SO_ORIGINAL_DST", libc::SOL_IPV6, 80),
    ] {
        ask(what, &tcp6, level, name, 64);
    }

    let udp = socket(libc::AF_INET, libc::SOCK_DGRAM);
    ask("UDP SO_TYPE", &udp, libc::SOL_SOCKET, libc::SO_TYPE, 4);

    // A peer with many supplementary groups: SO_PEERGROUPS answers more than a page.
    let groups: Vec<libc::gid_t> = (1..=PEER_GROUPS).collect();
    // SAFETY: the list outlives the call; the probe runs as root here.
    let rc = unsafe { libc::setgroups(groups.len(), groups.as_ptr()) };
    assert_eq!(rc, 0, "setgroups: {}", std::io::Error::last_os_error());
    let mut pair = [0; 2];
    // SAFETY: `pair` has room for the two descriptors.
    let rc = unsafe {
        libc::socketpair(
            libc::AF_UNIX,
            libc::SOCK_STREAM | libc::SOCK_CLOEXEC,
            0,
            pair.as_mut_ptr(),
        )
    };
    assert_eq!(rc, 0, "socketpair: {}", std::io::Error::last_os_error());
    // SAFETY: fresh descriptors nothing else owns.
    let (a, _b) = unsafe { (OwnedFd::from_raw_fd(pair[0]), OwnedFd::from_raw_fd(pair[1])) };
    ask(
        "SO_PEERGROUPS",
        &a,
        libc::SOL_SOCKET,
        libc::SO_PEERGROUPS,
        16 * PAGE,
    );
    ask(
        "SO_PEERGROUPS short",
        &a,
        libc::SOL_SOCKET,
        libc::SO_PEERGROUPS,
        16,
    );
    ask("Unix SO_TYPE", &a, libc::SOL_SOCKET, libc::SO_TYPE, 4);
    Value::Object(answers)
}
