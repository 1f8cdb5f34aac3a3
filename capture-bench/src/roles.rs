//! The benchmark's processes, each entered into its pod like a container's: the servers (an echo
//! proxy, a forwarding proxy, the upstream) and the load generator.

use std::{
    io::{Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    os::fd::AsRawFd as _,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, Instant},
};

use serde::{Deserialize, Serialize};

/// Request and response size of the request/response workloads.
pub const MESSAGE: usize = 64;
/// Write size of the stream workload.
pub const CHUNK: usize = 64 * 1024;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "snake_case")]
pub enum Workload {
    /// Connect, one request/response, close: the connection rate.
    Crr,
    /// Request/response on one persistent connection per worker.
    Rr,
    /// One-way bulk transfer on one connection per worker.
    Stream,
}

/// What one load run measured.
#[derive(Clone, Debug, Default, Serialize, Deserialize)]
pub struct LoadResult {
    pub ops: u64,
    pub bytes: u64,
    pub errors: u64,
    pub seconds: f64,
    /// Microseconds, per operation (request/response or connect+request/response+close).
    pub p50_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
}

fn exchange(s: &mut TcpStream, buf: &mut [u8; MESSAGE]) -> std::io::Result<()> {
    s.write_all(buf)?;
    s.read_exact(buf)
}

/// Serves request/response and streams on one accepted connection until the peer closes.
fn echo_conn(mut s: TcpStream) {
    let _ = s.set_nodelay(true);
    let mut buf = vec![0u8; CHUNK];
    let mut pending = 0;
    // Echo in MESSAGE-sized units; a stream's data (larger reads) is only consumed.
    while let Ok(n) = s.read(&mut buf[pending..]) {
        if n == 0 {
            return;
        }
        pending += n;
        if pending == MESSAGE {
            if s.write_all(&buf[..MESSAGE]).is_err() {
                return;
            }
            pending = 0;
        } else if pending > MESSAGE {
            pending = 0;
        }
    }
}

fn serve_forever(listener: TcpListener, threads: usize, handle: fn(TcpStream)) {
    let listener = Arc::new(listener);
    let workers: Vec<_> = (0..threads)
        .map(|_| {
            let l = Arc::clone(&listener);
            std::thread::spawn(move || {
                for conn in l.incoming().flatten() {
                    handle(conn);
                }
            })
        })
        .collect();
    for w in workers {
        let _ = w.join();
    }
}

/// A listener on `addr`; an IPv6 one `IPV6_V6ONLY`, so that it does not take the IPv4 port of
/// a listener beside it (as Envoy opens its IPv6 listeners).
fn bind(addr: SocketAddr) -> std::io::Result<TcpListener> {
    use nix::sys::socket::{self, sockopt, AddressFamily, SockFlag, SockType, SockaddrStorage};
    if addr.is_ipv4() {
        return TcpListener::bind(addr);
    }
    let fd = socket::socket(
        AddressFamily::Inet6,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    socket::setsockopt(&fd, sockopt::Ipv6V6Only, &true)?;
    socket::setsockopt(&fd, sockopt::ReuseAddr, &true)?;
    socket::bind(fd.as_raw_fd(), &SockaddrStorage::from(addr))?;
    socket::listen(
        &fd,
        socket::Backlog::new(1024).map_err(std::io::Error::from)?,
    )?;
    Ok(TcpListener::from(fd))
}

/// Listens on each address and echoes, with `threads` workers per listener.
pub fn echo(listen: &[SocketAddr], threads: usize) -> ! {
    let listeners: Vec<_> = listen
        .iter()
        .map(|a| bind(*a).unwrap_or_else(|e| panic!("bind {a}: {e}")))
        .collect();
    println!("ready");
    let _ = std::io::stdout().flush();
    let handles: Vec<_> = listeners
        .into_iter()
        .map(|l| std::thread::spawn(move || serve_forever(l, threads, echo_conn)))
        .collect();
    for h in handles {
        let _ = h.join();
    }
    std::process::exit(0)
}

static DEFAULT_UPSTREAM: std::sync::OnceLock<SocketAddr> = std::sync::OnceLock::new();

fn original_dst(s: &TcpStream) -> Option<SocketAddr> {
    let mut buf = [0u8; 16];
    let mut len = 16 as libc::socklen_t;
    // SAFETY: a 16-byte out-buffer for SO_ORIGINAL_DST.
    let rc = unsafe {
        libc::getsockopt(
            s.as_raw_fd(),
            libc::SOL_IP,
            80,
            buf.as_mut_ptr().cast(),
            &raw mut len,
        )
    };
    (rc == 0).then(|| {
        SocketAddr::from((
            [buf[4], buf[5], buf[6], buf[7]],
            u16::from_be_bytes([buf[2], buf[3]]),
        ))
    })
}

/// The shape of Envoy's outbound path: ask where the connection was going, connect there,
/// relay both ways.
fn forward_conn(client: TcpStream) {
    let Some(to) = original_dst(&client).or_else(|| DEFAULT_UPSTREAM.get().copied()) else {
        return;
    };
    let Ok(upstream) = TcpStream::connect(to) else {
        return;
    };
    let _ = client.set_nodelay(true);
    let _ = upstream.set_nodelay(true);
    let (mut c2, mut u2) = (
        client.try_clone().expect("clone"),
        upstream.try_clone().expect("clone"),
    );
    let back = std::thread::spawn(move || {
        let _ = std::io::copy(&mut u2, &mut c2);
        let _ = c2.shutdown(Shutdown::Write);
    });
    let (mut c, mut u) = (client, upstream);
    let _ = std::io::copy(&mut c, &mut u);
    let _ = u.shutdown(Shutdown::Write);
    let _ = back.join();
}

/// A forwarding proxy on `listen`, sending connections without an original destination to
/// `default_upstream`.
pub fn forward(listen: SocketAddr, default_upstream: SocketAddr, threads: usize) -> ! {
    let _ = DEFAULT_UPSTREAM.set(default_upstream);
    let l = TcpListener::bind(listen).unwrap_or_else(|e| panic!("bind {listen}: {e}"));
    println!("ready");
    let _ = std::io::stdout().flush();
    serve_forever(l, threads, forward_conn);
    std::process::exit(0)
}

fn percentile(sorted: &[u32], q: f64) -> f64 {
    if sorted.is_empty() {
        return 0.0;
    }
    let i = ((sorted.len() as f64 - 1.0) * q).round() as usize;
    f64::from(sorted[i.min(sorted.len() - 1)])
}

/// What one worker measured in the window. The worker locks it for a moment per operation,
/// never across one, so that the driver can read it while the worker is blocked.
#[derive(Default)]
struct Tally {
    ops: u64,
    bytes: u64,
    errors: u64,
    /// Microseconds per operation.
    lat: Vec<u32>,
}

/// How long the driver waits, once the window is over, for a worker still blocked in an
/// operation (a connect whose SYN is being retransmitted, say) before it counts the operation as
/// an error and leaves the worker behind: a sample lasts its window and this at most.
const STRAGGLER_WAIT: Duration = Duration::from_secs(2);

/// One worker's loop until `stop`, counting into `tally` while `record` is set.
fn worker(
    workload: Workload,
    target: SocketAddr,
    stop: &AtomicBool,
    record: &AtomicBool,
    tally: &std::sync::Mutex<Tally>,
) {
    let count = |done: std::io::Result<()>, t: Instant, bytes: u64| {
        if record.load(Ordering::Relaxed) {
            let mut tally = tally.lock().expect("tally");
            match done {
                Ok(()) => {
                    tally.ops += 1;
                    tally.bytes += bytes;
                    if bytes == 0 {
                        tally.lat.push(t.elapsed().as_micros() as u32);
                    }
                }
                Err(_) => tally.errors += 1,
            }
        }
    };
    let mut msg = [7u8; MESSAGE];
    match workload {
        Workload::Crr => {
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let done = TcpStream::connect(target).and_then(|mut s| {
                    s.set_nodelay(true)?;
                    exchange(&mut s, &mut msg)
                });
                count(done, t, 0);
            }
        }
        Workload::Rr => {
            let Ok(mut s) = TcpStream::connect(target) else {
                tally.lock().expect("tally").errors += 1;
                return;
            };
            let _ = s.set_nodelay(true);
            while !stop.load(Ordering::Relaxed) {
                let t = Instant::now();
                let done = exchange(&mut s, &mut msg);
                let failed = done.is_err();
                count(done, t, 0);
                if failed {
                    break;
                }
            }
        }
        Workload::Stream => {
            let Ok(mut s) = TcpStream::connect(target) else {
                tally.lock().expect("tally").errors += 1;
                return;
            };
            let chunk = vec![1u8; CHUNK];
            while !stop.load(Ordering::Relaxed) {
                let done = s.write_all(&chunk);
                let failed = done.is_err();
                count(done, Instant::now(), CHUNK as u64);
                if failed {
                    break;
                }
            }
        }
    }
}

/// Runs `concurrency` workers against `target` for `warmup` (discarded) then `duration`.
#[must_use]
pub fn load(
    workload: Workload,
    target: SocketAddr,
    concurrency: usize,
    warmup: Duration,
    duration: Duration,
) -> LoadResult {
    let stop = Arc::new(AtomicBool::new(false));
    let record = Arc::new(AtomicBool::new(false));
    let tallies: Vec<_> = (0..concurrency)
        .map(|_| Arc::new(std::sync::Mutex::new(Tally::default())))
        .collect();
    let workers: Vec<_> = tallies
        .iter()
        .map(|tally| {
            let (stop, record, tally) = (Arc::clone(&stop), Arc::clone(&record), Arc::clone(tally));
            std::thread::spawn(move || worker(workload, target, &stop, &record, &tally))
        })
        .collect();
    std::thread::sleep(warmup);
    record.store(true, Ordering::Relaxed);
    let start = Instant::now();
    std::thread::sleep(duration);
    record.store(false, Ordering::Relaxed);
    let seconds = start.elapsed().as_secs_f64();
    stop.store(true, Ordering::Relaxed);
    let deadline = Instant::now() + STRAGGLER_WAIT;
    while workers.iter().any(|w| !w.is_finished()) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(10));
    }
    // A worker still blocked is left to the process's exit; its operation failed the window.
    let stalled = workers.iter().filter(|w| !w.is_finished()).count() as u64;
    let mut r = LoadResult {
        seconds,
        errors: stalled,
        ..LoadResult::default()
    };
    let mut lat = Vec::new();
    for tally in &tallies {
        let tally = tally.lock().expect("tally");
        r.ops += tally.ops;
        r.bytes += tally.bytes;
        r.errors += tally.errors;
        lat.extend_from_slice(&tally.lat);
    }
    lat.sort_unstable();
    r.p50_us = percentile(&lat, 0.50);
    r.p99_us = percentile(&lat, 0.99);
    r.p999_us = percentile(&lat, 0.999);
    r
}
