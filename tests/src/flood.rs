//! Many connections at once: an app that opens thousands and holds them (`flood`), and a proxy
//! that accepts them all, reads each one's original destination and holds them too (`sink`).
//! The limits tests use them to count how many concurrent connections a captured pod holds and
//! whether every hand-off of an original destination arrived.

use std::{
    collections::{BTreeMap, HashMap},
    io::{self, BufRead as _, Write as _},
    net::{SocketAddr, TcpListener},
    os::fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc, Mutex,
    },
    time::{Duration, Instant},
};

use serde_json::{json, Value};

/// Descriptors a flood or a sink may hold (both sides of 30,000 connections, and then some).
const OPEN_FILES: libc::rlim_t = 200_000;

/// Raises the open-file limit (as root, before dropping privileges): to `OPEN_FILES` where the
/// process may raise its hard limit (`CAP_SYS_RESOURCE`), else to the hard limit. Returns it.
pub fn raise_open_files() -> io::Result<u64> {
    let set = |n: libc::rlim_t| {
        let limit = libc::rlimit {
            rlim_cur: n,
            rlim_max: n,
        };
        // SAFETY: a plain syscall on a valid struct.
        unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raw const limit) == 0 }
    };
    if set(OPEN_FILES) {
        return Ok(OPEN_FILES);
    }
    let mut now = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: as above.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &raw mut now) } != 0 || !set(now.rlim_max) {
        return Err(io::Error::last_os_error());
    }
    Ok(now.rlim_max)
}

/// How many connects each of `processes` flooding one pod at once may keep in flight. Every
/// connect in flight waits its turn for the CPU that completes handshakes, so the last of a
/// window waits about window / rate. With 8 processes of 512 each, an emulated 6.1 guest beside
/// two busy host CPUs made its slowest connect wait 3.8 to 5.5 s, past the flood's patience of
/// then 5 s: the flake of a CI run whose three VMs shared two cores. Together the processes now
/// keep half the loopback's per-CPU backlog (`net.core.netdev_max_backlog`, 1,000 by default:
/// 62 each), which also keeps every packet of theirs from being dropped there; the slowest
/// connect of the same run waits 1.0 to 1.3 s.
#[must_use]
pub fn window_for(processes: usize) -> usize {
    let backlog: usize = std::fs::read_to_string("/proc/sys/net/core/netdev_max_backlog")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(1000);
    (backlog / 2 / processes.max(1)).max(1)
}

/// The errno's name, as the reports key failures.
pub fn errno_name(errno: i32) -> String {
    match errno {
        libc::ECONNREFUSED => "ECONNREFUSED".into(),
        libc::EPERM => "EPERM".into(),
        libc::ETIMEDOUT => "ETIMEDOUT".into(),
        libc::EADDRNOTAVAIL => "EADDRNOTAVAIL".into(),
        libc::ENOENT => "ENOENT".into(),
        libc::ECONNRESET => "ECONNRESET".into(),
        libc::EMFILE => "EMFILE".into(),
        libc::ENOBUFS => "ENOBUFS".into(),
        other => format!("errno {other}"),
    }
}

/// `SO_ORIGINAL_DST` (`IP6T_SO_ORIGINAL_DST` for IPv6) of a socket, as a proxy asks it.
pub fn original_dst(fd: RawFd, ipv6: bool) -> io::Result<SocketAddr> {
    let mut buf = [0u8; 28];
    let mut len = if ipv6 { 28 } else { 16 } as libc::socklen_t;
    let level = if ipv6 { libc::SOL_IPV6 } else { libc::SOL_IP };
    // SAFETY: the buffer is at least `len` bytes.
    let rc = unsafe { libc::getsockopt(fd, level, 80, buf.as_mut_ptr().cast(), &raw mut len) };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    Ok(if ipv6 {
        let mut a = [0u8; 16];
        a.copy_from_slice(&buf[8..24]);
        (std::net::Ipv6Addr::from(a), port).into()
    } else {
        (
            std::net::Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]),
            port,
        )
            .into()
    })
}

/// What a sink has seen so far.
#[derive(Default)]
struct Seen {
    accepted: usize,
    orig: BTreeMap<String, usize>,
    orig_errors: BTreeMap<String, usize>,
    held: Vec<std::net::TcpStream>,
}

/// How a sink listens.
pub struct SinkOptions {
    pub backlog: i32,
    /// Accept only after a line `accept` on stdin.
    pub deferred: bool,
    /// One of several workers sharing the port (`SO_REUSEPORT`).
    pub reuseport: bool,
    /// `TCP_DEFER_ACCEPT`, in seconds.
    pub defer_accept: Option<i32>,
}

/// The proxy side: listens on `listen`, accepts, asks each connection's original destination
/// and holds it. A line `report` prints what it has seen as JSON; end of stdin ends it.
pub fn sink(listen: &[SocketAddr], options: &SinkOptions) -> io::Result<()> {
    let seen = Arc::new(Mutex::new(Seen::default()));
    let go = Arc::new(AtomicBool::new(!options.deferred));
    for addr in listen {
        let listener = listener(*addr, options)?;
        let (seen, go) = (Arc::clone(&seen), Arc::clone(&go));
        std::thread::spawn(move || accept_loop(&listener, &seen, &go));
    }
    println!("ready");
    io::stdout().flush()?;
    for line in io::stdin().lock().lines() {
        match line?.trim() {
            "accept" => go.store(true, Ordering::SeqCst),
            "report" => {
                let s = seen.lock().expect("sink state");
                println!(
                    "{}",
                    json!({ "accepted": s.accepted, "orig": s.orig, "orig_errors": s.orig_errors })
                );
                io::stdout().flush()?;
            }
            _ => {}
        }
    }
    Ok(())
}

fn listener(addr: SocketAddr, options: &SinkOptions) -> io::Result<TcpListener> {
    let family = if addr.is_ipv6() {
        libc::AF_INET6
    } else {
        libc::AF_INET
    };
    // SAFETY: plain syscalls; the descriptor is owned as soon as it exists.
    let fd = unsafe {
        let fd = libc::socket(family, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(fd)
    };
    let mut ints = vec![(libc::SOL_SOCKET, libc::SO_REUSEADDR, 1)];
    if options.reuseport {
        ints.push((libc::SOL_SOCKET, libc::SO_REUSEPORT, 1));
    }
    if addr.is_ipv6() {
        ints.push((libc::SOL_IPV6, libc::IPV6_V6ONLY, 1));
    }
    if let Some(secs) = options.defer_accept {
        ints.push((libc::IPPROTO_TCP, libc::TCP_DEFER_ACCEPT, secs));
    }
    for (level, name, value) in ints {
        set_int(&fd, level, name, value)?;
    }
    let (storage, len) = sockaddr_of(addr);
    // SAFETY: `storage` holds a sockaddr of `len` bytes.
    let bound = unsafe { libc::bind(fd.as_raw_fd(), (&raw const storage).cast(), len) };
    // SAFETY: a plain call on a socket this function owns.
    if bound != 0 || unsafe { libc::listen(fd.as_raw_fd(), options.backlog) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(TcpListener::from(fd))
}

/// setsockopt of an int option.
pub fn set_int(fd: &OwnedFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: an int option on a valid socket.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            level,
            name,
            (&raw const value).cast(),
            size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

fn accept_loop(listener: &TcpListener, seen: &Mutex<Seen>, go: &AtomicBool) {
    while !go.load(Ordering::SeqCst) {
        std::thread::sleep(Duration::from_millis(20));
    }
    for stream in listener.incoming() {
        let Ok(stream) = stream else { continue };
        let ipv6 = stream
            .local_addr()
            .is_ok_and(|a| matches!(a, SocketAddr::V6(v) if v.ip().to_ipv4_mapped().is_none()));
        let orig = original_dst(stream.as_raw_fd(), ipv6);
        let mut s = seen.lock().expect("sink state");
        s.accepted += 1;
        match orig {
            Ok(addr) => *s.orig.entry(addr.to_string()).or_default() += 1,
            Err(e) => {
                *s.orig_errors
                    .entry(errno_name(e.raw_os_error().unwrap_or(0)))
                    .or_default() += 1;
            }
        }
        s.held.push(stream);
    }
}

fn sockaddr_of(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: all-zero is a valid sockaddr_storage.
    let mut storage: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            let sin = libc::sockaddr_in {
                sin_family: libc::AF_INET as libc::sa_family_t,
                sin_port: a.port().to_be(),
                sin_addr: libc::in_addr {
                    s_addr: u32::from_ne_bytes(a.ip().octets()),
                },
                sin_zero: [0; 8],
            };
            // SAFETY: sockaddr_storage is larger than sockaddr_in and suitably aligned.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin) };
            size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            let sin6 = libc::sockaddr_in6 {
                sin6_family: libc::AF_INET6 as libc::sa_family_t,
                sin6_port: a.port().to_be(),
                sin6_flowinfo: 0,
                sin6_addr: libc::in6_addr {
                    s6_addr: a.ip().octets(),
                },
                sin6_scope_id: 0,
            };
            // SAFETY: as above.
            unsafe { std::ptr::write((&raw mut storage).cast(), sin6) };
            size_of::<libc::sockaddr_in6>()
        }
    };
    (storage, len as libc::socklen_t)
}

/// How a flood went.
pub struct FloodReport {
    pub established: Vec<OwnedFd>,
    pub errors: BTreeMap<String, usize>,
    pub seconds: f64,
    /// The longest a connect took to be established (what the patience bounds).
    pub slowest_connect: Duration,
}

impl FloodReport {
    #[must_use]
    pub fn to_json(&self, attempted: usize) -> Value {
        json!({
            "attempted": attempted,
            "established": self.established.len(),
            "errors": self.errors,
            "seconds": self.seconds,
            "slowest_connect_ms": self.slowest_connect.as_millis(),
        })
    }
}

/// The app side: `count` non-blocking connects, round-robin over `to`, at most `window` in
/// flight; one not established within `patience` counts as ETIMEDOUT. The established ones are
/// returned open.
pub fn flood(
    to: &[SocketAddr],
    count: usize,
    window: usize,
    patience: Duration,
) -> io::Result<FloodReport> {
    let start = Instant::now();
    // SAFETY: a plain syscall; the descriptor is owned at once.
    let epoll = unsafe {
        let fd = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(fd)
    };
    let mut report = FloodReport {
        established: Vec::with_capacity(count),
        errors: BTreeMap::new(),
        seconds: 0.0,
        slowest_connect: Duration::ZERO,
    };
    let mut in_flight: HashMap<RawFd, (OwnedFd, Instant)> = HashMap::new();
    let fail = |errors: &mut BTreeMap<String, usize>, errno: i32| {
        *errors.entry(errno_name(errno)).or_default() += 1;
    };
    let mut next = 0;
    let mut events = vec![libc::epoll_event { events: 0, u64: 0 }; 1024];
    while next < count || !in_flight.is_empty() {
        while next < count && in_flight.len() < window {
            let addr = to[next % to.len()];
            next += 1;
            match start_connect(addr) {
                Ok((fd, true)) => report.established.push(fd),
                Ok((fd, false)) => {
                    let mut ev = libc::epoll_event {
                        events: libc::EPOLLOUT as u32,
                        u64: fd.as_raw_fd() as u64,
                    };
                    // SAFETY: both descriptors are valid.
                    unsafe {
                        libc::epoll_ctl(
                            epoll.as_raw_fd(),
                            libc::EPOLL_CTL_ADD,
                            fd.as_raw_fd(),
                            &raw mut ev,
                        );
                    }
                    in_flight.insert(fd.as_raw_fd(), (fd, Instant::now()));
                }
                Err(e) => fail(&mut report.errors, e.raw_os_error().unwrap_or(0)),
            }
        }
        // SAFETY: `events` has room for its length.
        let n = unsafe {
            libc::epoll_wait(
                epoll.as_raw_fd(),
                events.as_mut_ptr(),
                events.len() as i32,
                50,
            )
        };
        for ev in events.iter().take(n.max(0) as usize) {
            let raw = ev.u64 as RawFd;
            let Some((fd, since)) = in_flight.remove(&raw) else {
                continue;
            };
            report.slowest_connect = report.slowest_connect.max(since.elapsed());
            // SAFETY: both descriptors are valid; deregistered before it is kept or closed.
            unsafe {
                libc::epoll_ctl(
                    epoll.as_raw_fd(),
                    libc::EPOLL_CTL_DEL,
                    raw,
                    std::ptr::null_mut(),
                );
            }
            match socket_error(&fd) {
                0 => report.established.push(fd),
                errno => fail(&mut report.errors, errno),
            }
        }
        let expired: Vec<RawFd> = in_flight
            .iter()
            .filter(|(_, (_, since))| since.elapsed() > patience)
            .map(|(raw, _)| *raw)
            .collect();
        for raw in expired {
            in_flight.remove(&raw);
            fail(&mut report.errors, libc::ETIMEDOUT);
        }
    }
    report.seconds = start.elapsed().as_secs_f64();
    Ok(report)
}

/// Starts one non-blocking connect: `(fd, true)` if it completed at once.
fn start_connect(addr: SocketAddr) -> io::Result<(OwnedFd, bool)> {
    let family = if addr.is_ipv6() {
        libc::AF_INET6
    } else {
        libc::AF_INET
    };
    // SAFETY: plain syscalls; the descriptor is owned as soon as it exists.
    let fd = unsafe {
        let fd = libc::socket(
            family,
            libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC,
            0,
        );
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        OwnedFd::from_raw_fd(fd)
    };
    let (storage, len) = sockaddr_of(addr);
    // SAFETY: `storage` holds a sockaddr of `len` bytes.
    if unsafe { libc::connect(fd.as_raw_fd(), (&raw const storage).cast(), len) } == 0 {
        return Ok((fd, true));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() == Some(libc::EINPROGRESS) {
        Ok((fd, false))
    } else {
        Err(err)
    }
}

fn socket_error(fd: &OwnedFd) -> i32 {
    let mut err: libc::c_int = 0;
    let mut len = size_of::<libc::c_int>() as libc::socklen_t;
    // SAFETY: an int-sized out-buffer.
    let rc = unsafe {
        libc::getsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_ERROR,
            (&raw mut err).cast(),
            &raw mut len,
        )
    };
    if rc != 0 {
        return io::Error::last_os_error().raw_os_error().unwrap_or(0);
    }
    err
}

/// Holds a flood's connections, taking commands from stdin: `send` writes a byte on each (and
/// prints `sent`), `reset` closes them all with a RST (and prints `closed`); end of stdin ends it.
pub fn hold(mut established: Vec<OwnedFd>) -> io::Result<()> {
    for line in io::stdin().lock().lines() {
        match line?.trim() {
            "send" => {
                for fd in &established {
                    // SAFETY: one byte from a valid buffer on a valid socket.
                    unsafe {
                        libc::send(fd.as_raw_fd(), b"x".as_ptr().cast(), 1, libc::MSG_NOSIGNAL)
                    };
                }
                println!("sent");
            }
            "reset" => {
                let linger = libc::linger {
                    l_onoff: 1,
                    l_linger: 0,
                };
                for fd in &established {
                    // SAFETY: a linger struct on a valid socket.
                    unsafe {
                        libc::setsockopt(
                            fd.as_raw_fd(),
                            libc::SOL_SOCKET,
                            libc::SO_LINGER,
                            (&raw const linger).cast(),
                            size_of::<libc::linger>() as libc::socklen_t,
                        );
                    }
                }
                established.clear();
                println!("closed");
            }
            _ => continue,
        }
        io::stdout().flush()?;
    }
    Ok(())
}
