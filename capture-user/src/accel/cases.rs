//! The acceleration's correctness cases. Each runs one workload over a connection from the app to
//! the proxy (made through capture, so acceleration applies when it is on) and writes down what
//! the sockets answered: bytes (as digests), return values, errno, readiness. The same case run
//! with and without acceleration must write down the same thing.

use std::{
    io::{self, Read as _, Write as _},
    net::{TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    time::Duration,
};

use super::case_io::{
    digest, errno_result, inq, outcome, pattern, pipe, poll_one, read_exactly, recv, send, set_int,
    splice, tempfile, wait_readable,
};

/// What one case observed, line by line.
pub type Observation = Vec<String>;

/// Makes a connection through capture: the app's socket and the proxy's accepted one.
pub struct Pair<'a> {
    pub listener: &'a TcpListener,
    /// Where the app connects; capture redirects it to the listener.
    pub destination: std::net::SocketAddr,
}

impl Pair<'_> {
    fn connect(&self) -> io::Result<(TcpStream, TcpStream)> {
        let app = TcpStream::connect_timeout(&self.destination, Duration::from_secs(5))?;
        let (proxy, _) = self.listener.accept()?;
        for s in [&app, &proxy] {
            s.set_read_timeout(Some(Duration::from_secs(5)))?;
            s.set_write_timeout(Some(Duration::from_secs(5)))?;
        }
        Ok((app, proxy))
    }
}

pub type Case = fn(&Pair<'_>) -> io::Result<Observation>;

/// Every case, by name.
pub const CASES: [(&str, Case); 22] = [
    ("small_writes", small_writes),
    ("large_writes_16mib", large_writes),
    ("partial_reads", partial_reads),
    ("msg_peek", msg_peek),
    ("msg_more", msg_more),
    ("writev", writev),
    ("sendfile", sendfile),
    ("splice_both_ways", splice_both_ways),
    ("half_close_by_app", |p| half_close(p, true)),
    ("half_close_by_proxy", |p| half_close(p, false)),
    ("close_with_unread_data_by_proxy", |p| {
        close_with_unread(p, false)
    }),
    ("close_with_unread_data_by_app", |p| {
        close_with_unread(p, true)
    }),
    ("poll_and_epoll_readiness", readiness),
    ("so_rcvlowat", rcvlowat),
    ("fionread", fionread),
    ("nonblocking_backpressure", backpressure),
    ("many_concurrent_connections", many_connections),
    ("socket_handed_to_another_process", handed_over),
    ("proxy_closes_first", |p| closes_first(p, false)),
    ("app_closes_first", |p| closes_first(p, true)),
    ("ulp_tls_refused_or_kept", ulp_tls),
    ("original_destination_and_peer", original_destination),
];

fn small_writes(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, mut proxy) = p.connect()?;
    let mut obs = Vec::new();
    for (i, len) in [1usize, 2, 100, 1000, 4096, 65536].into_iter().enumerate() {
        let data = pattern(len, i as u8);
        app.write_all(&data)?;
        obs.push(format!(
            "to proxy {}",
            digest(&read_exactly(&mut proxy, len)?)
        ));
        proxy.write_all(&data)?;
        obs.push(format!("to app {}", digest(&read_exactly(&mut app, len)?)));
    }
    Ok(obs)
}

/// Writes `data` on one thread while the other side reads it all, and says whether what arrived
/// is what was sent (compared, not digested: a digest of 16 MiB costs an unoptimized build
/// seconds under emulation, a comparison is a memcmp).
fn stream(mut from: TcpStream, mut to: TcpStream, data: Vec<u8>) -> io::Result<String> {
    let len = data.len();
    let sent = std::sync::Arc::new(data);
    let writer = {
        let sent = std::sync::Arc::clone(&sent);
        std::thread::spawn(move || from.write_all(&sent).map(|()| from))
    };
    let got = read_exactly(&mut to, len)?;
    writer.join().expect("writer")?;
    Ok(if got == *sent {
        format!("{len} bytes, as sent")
    } else {
        format!("{len} bytes, not as sent: {}", digest(&got))
    })
}

fn large_writes(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let size = 16 << 20;
    Ok(vec![
        format!(
            "to proxy {}",
            stream(app.try_clone()?, proxy.try_clone()?, pattern(size, 1))?
        ),
        format!("to app {}", stream(proxy, app, pattern(size, 2))?),
    ])
}

fn partial_reads(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, mut proxy) = p.connect()?;
    let data = pattern(10_000, 3);
    app.write_all(&data)?;
    let mut got = Vec::new();
    let mut chunk = [0u8; 7];
    while got.len() < data.len() {
        let n = proxy.read(&mut chunk)?;
        if n == 0 {
            break;
        }
        got.extend_from_slice(&chunk[..n]);
    }
    Ok(vec![digest(&got)])
}

fn msg_peek(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, mut proxy) = p.connect()?;
    app.write_all(b"hello world")?;
    wait_readable(proxy.as_raw_fd())?;
    let mut peeked = [0u8; 5];
    let n = recv(proxy.as_raw_fd(), &mut peeked, libc::MSG_PEEK)?;
    let rest = read_exactly(&mut proxy, 11)?;
    Ok(vec![
        format!("peeked {:?}", String::from_utf8_lossy(&peeked[..n])),
        format!("read {:?}", String::from_utf8_lossy(&rest)),
    ])
}

fn msg_more(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, mut proxy) = p.connect()?;
    let first = send(app.as_raw_fd(), b"abc", libc::MSG_MORE)?;
    let second = send(app.as_raw_fd(), b"def", 0)?;
    let got = read_exactly(&mut proxy, 6)?;
    Ok(vec![
        format!("sent {first} then {second}"),
        format!("read {:?}", String::from_utf8_lossy(&got)),
    ])
}

fn writev(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, mut proxy) = p.connect()?;
    let parts: [&[u8]; 3] = [b"one,", b"two,", &pattern(5000, 4)];
    let iov: Vec<libc::iovec> = parts
        .iter()
        .map(|b| libc::iovec {
            iov_base: b.as_ptr().cast_mut().cast(),
            iov_len: b.len(),
        })
        .collect();
    // SAFETY: every iovec points into a live slice of its length.
    let n = errno_result(unsafe { libc::writev(app.as_raw_fd(), iov.as_ptr(), 3) })?;
    let got = read_exactly(&mut proxy, n)?;
    Ok(vec![format!("wrote {n}"), digest(&got)])
}

fn sendfile(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, mut proxy) = p.connect()?;
    let data = pattern(1 << 20, 5);
    let mut file = tempfile()?;
    file.write_all(&data)?;
    let mut offset: libc::off_t = 0;
    let mut sent = 0;
    while sent < data.len() {
        // SAFETY: plain fds and a valid offset pointer.
        let n = errno_result(unsafe {
            libc::sendfile(
                app.as_raw_fd(),
                file.as_raw_fd(),
                &raw mut offset,
                data.len() - sent,
            )
        })?;
        if n == 0 {
            break;
        }
        sent += n;
    }
    Ok(vec![
        format!("sent {sent}"),
        digest(&read_exactly(&mut proxy, sent)?),
    ])
}

/// App to proxy through `splice` on both ends: pipe to the app's socket, then the proxy's socket
/// to a pipe.
fn splice_both_ways(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let data = pattern(60_000, 6);
    let (in_r, mut in_w) = pipe()?;
    let (mut out_r, out_w) = pipe()?;
    let mut obs = Vec::new();
    in_w.write_all(&data)?;
    let mut sent = 0;
    while sent < data.len() {
        sent += splice(in_r.as_raw_fd(), app.as_raw_fd(), data.len() - sent)?;
    }
    obs.push(format!("spliced in {sent}"));
    let mut got = Vec::new();
    while got.len() < data.len() {
        wait_readable(proxy.as_raw_fd())?;
        let n = splice(proxy.as_raw_fd(), out_w.as_raw_fd(), data.len() - got.len())?;
        if n == 0 {
            break;
        }
        let mut buf = vec![0; n];
        out_r.read_exact(&mut buf)?;
        got.extend_from_slice(&buf);
    }
    obs.push(format!("spliced out {}", digest(&got)));
    Ok(obs)
}

/// One side writes and shuts its writing half: the other reads the bytes, then end of stream,
/// and can still answer.
fn half_close(p: &Pair<'_>, by_app: bool) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let (mut closer, mut other) = if by_app { (app, proxy) } else { (proxy, app) };
    closer.write_all(b"request")?;
    closer.shutdown(std::net::Shutdown::Write)?;
    let mut got = Vec::new();
    other.read_to_end(&mut got)?;
    other.write_all(b"response")?;
    other.shutdown(std::net::Shutdown::Write)?;
    let mut answer = Vec::new();
    closer.read_to_end(&mut answer)?;
    Ok(vec![
        format!(
            "other read {:?} then end of stream",
            String::from_utf8_lossy(&got)
        ),
        format!(
            "closer read {:?} then end of stream",
            String::from_utf8_lossy(&answer)
        ),
    ])
}

/// One side closes with bytes it never read: TCP resets the connection, and the other side's
/// next read says so.
fn close_with_unread(p: &Pair<'_>, by_app: bool) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let (closer, mut other) = if by_app { (app, proxy) } else { (proxy, app) };
    other.write_all(&pattern(100, 7))?;
    wait_readable(closer.as_raw_fd())?;
    drop(closer);
    std::thread::sleep(Duration::from_millis(100));
    let mut buf = [0u8; 16];
    Ok(vec![outcome("read after the close", other.read(&mut buf))])
}

fn readiness(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, proxy) = p.connect()?;
    let fd = proxy.as_raw_fd();
    let mut obs = vec![format!(
        "poll before: {:#x}",
        poll_one(fd, libc::POLLIN, 0)?
    )];
    // SAFETY: plain epoll calls on valid fds; the event buffer has room for one.
    let ready = unsafe {
        let ep = libc::epoll_create1(libc::EPOLL_CLOEXEC);
        let mut ev = libc::epoll_event {
            events: (libc::EPOLLIN | libc::EPOLLET) as u32,
            u64: 1,
        };
        libc::epoll_ctl(ep, libc::EPOLL_CTL_ADD, fd, &raw mut ev);
        app.write_all(b"x")?;
        let mut out = [libc::epoll_event { events: 0, u64: 0 }];
        let n = libc::epoll_wait(ep, out.as_mut_ptr(), 1, 2000);
        let again = libc::epoll_wait(ep, out.as_mut_ptr(), 1, 50);
        libc::close(ep);
        (n, again)
    };
    obs.push(format!(
        "epoll after a write: {} ready, then {} (edge)",
        ready.0, ready.1
    ));
    obs.push(format!(
        "poll after: {:#x}",
        poll_one(fd, libc::POLLIN, 2000)?
    ));
    Ok(obs)
}

fn rcvlowat(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, mut proxy) = p.connect()?;
    let fd = proxy.as_raw_fd();
    set_int(fd, libc::SOL_SOCKET, libc::SO_RCVLOWAT, 100)?;
    app.write_all(&pattern(50, 8))?;
    let below = poll_one(fd, libc::POLLIN, 300)?;
    app.write_all(&pattern(50, 9))?;
    let above = poll_one(fd, libc::POLLIN, 2000)?;
    let got = read_exactly(&mut proxy, 100)?;
    Ok(vec![
        format!("poll with 50 of 100 bytes: {below:#x}"),
        format!("poll with 100 of 100 bytes: {above:#x}"),
        digest(&got),
    ])
}

fn fionread(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, proxy) = p.connect()?;
    app.write_all(&pattern(1234, 10))?;
    let ready = poll_one(proxy.as_raw_fd(), libc::POLLIN, 2000)?;
    std::thread::sleep(Duration::from_millis(50));
    Ok(vec![
        format!("poll {ready:#x}"),
        outcome("FIONREAD", inq(proxy.as_raw_fd())),
    ])
}

/// A non-blocking writer fills the buffers until EAGAIN, the reader drains, and the writer can
/// write again: every byte arrives, in order.
fn backpressure(p: &Pair<'_>) -> io::Result<Observation> {
    let (mut app, mut proxy) = p.connect()?;
    app.set_nonblocking(true)?;
    let chunk = pattern(65536, 11);
    let mut written = 0usize;
    let mut stalled = false;
    // Far beyond what TCP's buffers hold (a few MiB at most), so a writer that never stalls by
    // then never would.
    while written < (32 << 20) {
        match app.write(&chunk) {
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                stalled = true;
                break;
            }
            Err(e) => return Err(e),
        }
    }
    let mut expected = Vec::with_capacity(written);
    while expected.len() < written {
        let take = (written - expected.len()).min(chunk.len());
        expected.extend_from_slice(&chunk[..take]);
    }
    let got = read_exactly(&mut proxy, written)?;
    let writable = poll_one(app.as_raw_fd(), libc::POLLOUT, 2000)?;
    Ok(vec![
        format!("writes stalled with EAGAIN: {stalled}"),
        format!("every byte arrived in order: {}", got == expected),
        format!("writable after the drain: {:#x}", writable & libc::POLLOUT),
    ])
}

fn many_connections(p: &Pair<'_>) -> io::Result<Observation> {
    let pairs: Vec<(TcpStream, TcpStream)> =
        (0..64).map(|_| p.connect()).collect::<Result<_, _>>()?;
    let handles: Vec<_> = pairs
        .into_iter()
        .enumerate()
        .map(|(i, (mut app, mut proxy))| {
            std::thread::spawn(move || -> io::Result<bool> {
                let data = pattern(20_000, i as u8);
                let writer = {
                    let data = data.clone();
                    let mut app = app.try_clone()?;
                    std::thread::spawn(move || app.write_all(&data))
                };
                let got = read_exactly(&mut proxy, data.len())?;
                writer.join().expect("writer")?;
                proxy.write_all(&got)?;
                let back = read_exactly(&mut app, data.len())?;
                Ok(got == data && back == data)
            })
        })
        .collect();
    let intact = handles
        .into_iter()
        .map(|h| h.join().expect("connection thread"))
        .collect::<Result<Vec<_>, _>>()?;
    Ok(vec![format!(
        "{} of {} connections intact both ways",
        intact.iter().filter(|ok| **ok).count(),
        intact.len()
    )])
}

/// The app's socket is written by a forked process (as a socket passed to a worker would be).
fn handed_over(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, mut proxy) = p.connect()?;
    let msg = b"written by another process";
    // SAFETY: the child only calls write(2) and _exit(2), both async-signal-safe.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: as above.
        unsafe {
            let n = libc::write(app.as_raw_fd(), msg.as_ptr().cast(), msg.len());
            libc::_exit(i32::from(n != msg.len() as isize));
        }
    }
    if pid < 0 {
        return Err(io::Error::last_os_error());
    }
    let mut status = 0;
    // SAFETY: waits for the child just forked.
    unsafe { libc::waitpid(pid, &raw mut status, 0) };
    drop(app);
    let got = read_exactly(&mut proxy, msg.len())?;
    Ok(vec![
        format!("child exit status {status}"),
        format!("read {:?}", String::from_utf8_lossy(&got)),
    ])
}

/// One side says goodbye and closes; the other reads it, then end of stream, and its writes
/// then fail as TCP makes them.
fn closes_first(p: &Pair<'_>, app_first: bool) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let (mut first, mut second) = if app_first {
        (app, proxy)
    } else {
        (proxy, app)
    };
    first.write_all(b"bye")?;
    drop(first);
    let mut got = Vec::new();
    let end = second.read_to_end(&mut got);
    let write1 = second.write(b"late");
    std::thread::sleep(Duration::from_millis(100));
    let write2 = second.write(b"later");
    Ok(vec![
        format!("read {:?}", String::from_utf8_lossy(&got)),
        outcome("end of stream", end),
        outcome("first write after", write1.map(|_| ())),
        outcome("second write after", write2.map(|_| ())),
    ])
}

/// kTLS on the app's socket: the kernel either takes it (and the proxy reads a TLS record) or
/// refuses it; either way exactly as without acceleration.
fn ulp_tls(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, mut proxy) = p.connect()?;
    let name = b"tls";
    // SAFETY: a byte string and its length.
    let rc = unsafe {
        libc::setsockopt(
            app.as_raw_fd(),
            libc::SOL_TCP,
            libc::TCP_ULP,
            name.as_ptr().cast(),
            name.len() as u32,
        )
    };
    let set = if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    };
    let mut obs = vec![outcome(
        "TCP_ULP tls",
        set.as_ref().copied().map_err(|e| io::Error::from(e.kind())),
    )];
    if set.is_ok() {
        // TLS 1.2, AES-GCM-128, a fixed all-zero key: the bytes on the wire are deterministic.
        let mut info = [0u8; 40];
        info[0..2].copy_from_slice(&0x0303u16.to_ne_bytes());
        info[2..4].copy_from_slice(&51u16.to_ne_bytes());
        // SAFETY: the crypto info buffer and its length.
        let rc = unsafe {
            libc::setsockopt(
                app.as_raw_fd(),
                282,
                1,
                info.as_ptr().cast(),
                info.len() as u32,
            )
        };
        obs.push(format!(
            "TLS_TX: {}",
            if rc == 0 { "ok" } else { "refused" }
        ));
        if rc == 0 {
            let n = send(app.as_raw_fd(), b"secret", 0)?;
            // A record: 5 header bytes, 8 explicit nonce bytes, the data, 16 tag bytes.
            obs.push(format!(
                "record {}",
                digest(&read_exactly(&mut proxy, n + 29)?)
            ));
        }
    }
    Ok(obs)
}

fn original_destination(p: &Pair<'_>) -> io::Result<Observation> {
    let (app, proxy) = p.connect()?;
    let orig = crate::socket_fds::original_dst(&proxy, false);
    Ok(vec![
        format!("SO_ORIGINAL_DST {orig:?}"),
        outcome("app's peer", app.peer_addr()),
    ])
}
