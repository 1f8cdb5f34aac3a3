//! `capture validate`: what Istio's `istio-validation` init container does, for either backend
//! (parity-spec.md section G). Run in the pod as the proxy's uid before the proxy starts, it listens where
//! the proxy would, dials `127.0.0.6:15002` from `127.0.0.1`, and passes only when that connection
//! arrives on the inbound listener with 15002 as its original destination — which happens only if
//! capture is in force for this pod and this uid.

use std::{
    net::{Ipv4Addr, SocketAddr, SocketAddrV4, TcpListener},
    os::fd::AsRawFd as _,
    time::{Duration, Instant},
};

use nix::sys::socket::{bind, connect, socket, AddressFamily, SockFlag, SockType, SockaddrIn};

/// Istio's validation target: the inbound passthrough address and a port nothing listens on.
pub const PROBE_TARGET: SocketAddrV4 = SocketAddrV4::new(Ipv4Addr::new(127, 0, 0, 6), 15002);
/// Istio's validator exits with this code when capture is not in force.
pub const NOT_CAPTURED_EXIT: u8 = 126;

#[derive(Debug, thiserror::Error)]
pub enum ValidateError {
    #[error(
        "cannot listen on {addr} ({source}); run validate before the proxy starts, in the pod"
    )]
    Listen {
        addr: SocketAddr,
        source: std::io::Error,
    },
    #[error("capture is not in force: no probe to {PROBE_TARGET} reached the inbound listener {inbound} within {secs:.1}s ({last}); check `capture status` for this pod and that validate runs as the proxy's uid")]
    NotCaptured {
        inbound: SocketAddr,
        secs: f64,
        last: String,
    },
}

/// What a passing validation saw.
#[derive(Debug)]
pub struct Validated {
    pub original_dst: SocketAddr,
    pub elapsed: Duration,
}

fn listen(addr: SocketAddr) -> Result<TcpListener, ValidateError> {
    let l = TcpListener::bind(addr).map_err(|source| ValidateError::Listen { addr, source })?;
    l.set_nonblocking(true)
        .map_err(|source| ValidateError::Listen { addr, source })?;
    Ok(l)
}

/// `SO_ORIGINAL_DST` of an accepted IPv4 socket.
fn original_dst(fd: i32) -> std::io::Result<SocketAddr> {
    let mut buf = [0u8; 16];
    let mut len = buf.len() as libc::socklen_t;
    // SAFETY: the buffer holds `len` bytes.
    let rc =
        unsafe { libc::getsockopt(fd, libc::SOL_IP, 80, buf.as_mut_ptr().cast(), &raw mut len) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    let port = u16::from_be_bytes([buf[2], buf[3]]);
    Ok(SocketAddr::new(
        Ipv4Addr::new(buf[4], buf[5], buf[6], buf[7]).into(),
        port,
    ))
}

/// One probe connection from 127.0.0.1 to the target.
fn dial() -> std::io::Result<std::os::fd::OwnedFd> {
    let fd = socket(
        AddressFamily::Inet,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )?;
    bind(
        fd.as_raw_fd(),
        &SockaddrIn::from(SocketAddrV4::new(Ipv4Addr::LOCALHOST, 0)),
    )?;
    connect(fd.as_raw_fd(), &SockaddrIn::from(PROBE_TARGET))?;
    Ok(fd)
}

/// Probes once a second until a probe arrives captured or `timeout` passes.
pub fn validate(
    outbound_port: u16,
    inbound_port: u16,
    timeout: Duration,
) -> Result<Validated, ValidateError> {
    let start = Instant::now();
    // The outbound listener only stands where the proxy's would: a probe must not land there.
    let _outbound = listen(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), outbound_port))?;
    let inbound_addr = SocketAddr::new(Ipv4Addr::LOCALHOST.into(), inbound_port);
    let inbound = listen(inbound_addr)?;
    let mut last = String::from("no attempt yet");
    while start.elapsed() < timeout {
        let round = Instant::now();
        match dial() {
            Ok(_conn) => {
                while round.elapsed() < Duration::from_secs(1) && start.elapsed() < timeout {
                    match inbound.accept() {
                        Ok((stream, _)) => match original_dst(stream.as_raw_fd()) {
                            Ok(orig) if orig.port() == PROBE_TARGET.port() => {
                                return Ok(Validated {
                                    original_dst: orig,
                                    elapsed: start.elapsed(),
                                });
                            }
                            Ok(orig) => {
                                last = format!(
                                    "a connection arrived with original destination {orig}"
                                );
                            }
                            Err(e) => {
                                last = format!(
                                    "a connection arrived without an original destination ({e})"
                                );
                            }
                        },
                        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                            std::thread::sleep(Duration::from_millis(20));
                        }
                        Err(e) => last = format!("accept failed: {e}"),
                    }
                }
            }
            Err(e) => {
                last = format!("the probe connection failed: {e}");
                let rest = Duration::from_secs(1).saturating_sub(round.elapsed());
                std::thread::sleep(rest.min(timeout.saturating_sub(start.elapsed())));
            }
        }
    }
    Err(ValidateError::NotCaptured {
        inbound: inbound_addr,
        secs: timeout.as_secs_f64(),
        last,
    })
}
