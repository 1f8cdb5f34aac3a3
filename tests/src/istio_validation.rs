//! Istio's `istio-validation` init container, as its source behaves
//! (`tools/istio-iptables/pkg/validation/validator.go` in istio/istio): what the injector runs,
//! as the proxy's uid and gid, in every pod of a mesh whose CNI sets up capture, and what keeps
//! the pod from starting when capture is not in force. Written here from that file, independent
//! of `capture validate`, so that the tests check capture against Istio's own check.
//!
//! - It listens on the loopback address of the pod's family (`127.0.0.1`, or `::1` when the
//!   pod's address is IPv6), on the proxy's outbound port and its inbound capture port (15001,
//!   15006), with `SO_REUSEADDR`; a port it cannot bind is passed over while one remains.
//! - Once listening, it connects once a second from that loopback address (port 0) to
//!   `127.0.0.6:15002` (`[::6]:15002` for IPv6), the probe port no listener has.
//! - For each connection a listener accepts it reads the original destination
//!   (`SO_ORIGINAL_DST`, `IP6T_SO_ORIGINAL_DST` for IPv6), writes its port back and closes it;
//!   the check passes when that port is 15002. It fails when the timeout passes first.

use std::{
    io::Write as _,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream},
    os::fd::{AsRawFd as _, OwnedFd},
    sync::mpsc,
    time::Duration,
};

use nix::sys::socket::{
    bind, connect, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag, SockType,
    SockaddrStorage,
};

use crate::{
    cni::Pod,
    probe::{probe_in, Who},
};

/// Istio's defaults (`tools/istio-iptables/pkg/config`): the proxy's ports and the probe's.
pub const PROXY_PORT: u16 = 15001;
pub const INBOUND_CAPTURE_PORT: u16 = 15006;
pub const PROBE_PORT: u16 = 15002;

/// The check run in `pod` as its proxy, as the injector runs it (`capture-probe
/// istio-validation`); `Err` with its reason when it fails.
pub fn run_in(pod: &Pod, ipv6: bool, timeout: Duration) -> Result<(), String> {
    let mut cmd = probe_in(&pod.netns.path(), Some(&pod.cgroup), Some(&Who::proxy()));
    cmd.arg("istio-validation")
        .arg("--timeout-secs")
        .arg(timeout.as_secs().to_string());
    if ipv6 {
        cmd.arg("--ipv6");
    }
    let out = cmd.output().expect("capture-probe");
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).into_owned())
    }
}

/// Runs the check; `Ok` once a connection to the probe address arrives with the probe port as
/// its original destination, `Err(why)` when `timeout` passes first or nothing can listen.
pub fn validate(ipv6: bool, timeout: Duration) -> Result<(), String> {
    let (listen_ip, server_ip): (IpAddr, IpAddr) = if ipv6 {
        (
            Ipv6Addr::LOCALHOST.into(),
            Ipv6Addr::new(0, 0, 0, 0, 0, 0, 0, 6).into(),
        )
    } else {
        (
            Ipv4Addr::LOCALHOST.into(),
            Ipv4Addr::new(127, 0, 0, 6).into(),
        )
    };
    let (done, passed) = mpsc::channel();
    let mut listening = Vec::new();
    for port in [PROXY_PORT, INBOUND_CAPTURE_PORT] {
        let addr = SocketAddr::new(listen_ip, port);
        match listen_reusing(addr) {
            Ok(listener) => {
                listening.push(addr);
                let done = done.clone();
                std::thread::spawn(move || restore_original_port(&listener, ipv6, &done));
            }
            Err(e) => eprintln!("istio-validation: cannot listen on {addr}: {e}"),
        }
    }
    if listening.is_empty() {
        return Err("no listener available".into());
    }
    let probe = SocketAddr::new(server_ip, PROBE_PORT);
    std::thread::spawn(move || loop {
        let _ = connect_from(SocketAddr::new(listen_ip, 0), probe);
        std::thread::sleep(Duration::from_secs(1));
    });
    passed
        .recv_timeout(timeout)
        .map_err(|_| format!("validation timeout: no connection to {probe} reached {listening:?} with {PROBE_PORT} as its original destination"))
}

fn restore_original_port(listener: &TcpListener, ipv6: bool, done: &mpsc::Sender<()>) {
    for stream in listener.incoming().flatten() {
        let Ok(original) = crate::flood::original_dst(stream.as_raw_fd(), ipv6) else {
            continue;
        };
        let _ = (&stream).write_all(original.port().to_string().as_bytes());
        drop(stream);
        if original.port() == PROBE_PORT {
            let _ = done.send(());
            return;
        }
    }
}

fn listen_reusing(addr: SocketAddr) -> nix::Result<TcpListener> {
    let socket = new_socket(addr)?;
    setsockopt(&socket, sockopt::ReuseAddr, &true)?;
    bind(socket.as_raw_fd(), &SockaddrStorage::from(addr))?;
    listen(&socket, Backlog::new(128)?)?;
    Ok(TcpListener::from(socket))
}

/// A TCP connection from `local` (bound first, as the validator's client does) to `to`.
fn connect_from(local: SocketAddr, to: SocketAddr) -> nix::Result<TcpStream> {
    let socket = new_socket(local)?;
    bind(socket.as_raw_fd(), &SockaddrStorage::from(local))?;
    connect(socket.as_raw_fd(), &SockaddrStorage::from(to))?;
    Ok(TcpStream::from(socket))
}

fn new_socket(addr: SocketAddr) -> nix::Result<OwnedFd> {
    let family = if addr.is_ipv6() {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
}
