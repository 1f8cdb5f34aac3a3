//! The tests' traffic probe. It enters a pod (cgroup, netns, identity) the way a container's
//! process would, then serves or connects and prints what it saw as one JSON line.
//!
//! `serve` answers every TCP connection with a JSON line naming the listener, its local and peer
//! address and `SO_ORIGINAL_DST`, and echoes UDP datagrams; `connect` prints its own view plus
//! the server's line.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    net::{SocketAddr, TcpStream, UdpSocket},
    os::fd::AsRawFd as _,
    path::PathBuf,
    time::Duration,
};

use capture_tests::accepted::errno_name;
use clap::{Parser, Subcommand};
use serde_json::{json, Value};

#[derive(Parser)]
struct Args {
    /// Join this cgroup (v2 directory) first.
    #[arg(long)]
    cgroup: Option<PathBuf>,
    /// Enter this network namespace.
    #[arg(long)]
    netns: Option<PathBuf>,
    /// Then this user namespace (the pod's own): --uid and --gid are ids inside it.
    #[arg(long)]
    userns: Option<PathBuf>,
    /// Become this uid (after joining the pod).
    #[arg(long)]
    uid: Option<u32>,
    /// Become this primary gid.
    #[arg(long)]
    gid: Option<u32>,
    /// Effective (and so file-system) ids UID:GID, the real ones staying --uid/--gid.
    #[arg(long)]
    effective: Option<String>,
    /// Supplementary groups, comma-separated.
    #[arg(long, value_delimiter = ',')]
    groups: Vec<u32>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve until killed. Prints `ready` once every listener is bound.
    Serve {
        /// NAME=ADDR: a TCP listener reporting itself as NAME.
        #[arg(long = "tcp")]
        tcp: Vec<String>,
        /// NAME=ADDR: a UDP echo socket.
        #[arg(long = "udp")]
        udp: Vec<String>,
        /// Transparent listeners (`IP_TRANSPARENT`), as a TPROXY-mode proxy's.
        #[arg(long)]
        transparent: bool,
        /// `SO_REUSEPORT` listeners, as Envoy's workers open them (one group per address across
        /// processes of the same uid).
        #[arg(long)]
        reuseport: bool,
        /// IPv6 listeners take IPv4 connections too (`IPV6_V6ONLY` off), as a proxy on `[::]` alone.
        #[arg(long)]
        dual_stack: bool,
        /// Before listening, connect here until a connection is served (every 10 ms, as a proxy
        /// retries its control plane), and print `first connection after N ms (M refused)`.
        #[arg(long)]
        dial_first: Option<SocketAddr>,
    },
    /// Run a program inside the pod, as the given identity.
    Exec {
        #[arg(trailing_var_arg = true, required = true)]
        argv: Vec<String>,
    },
    /// Connect (TCP) or exchange once (UDP), print `ready`, wait for a line on stdin (or
    /// `--for-secs`), then ask again on the same socket and print the first and second outcomes:
    /// what an established connection sees before and after a change to the node.
    Hold {
        to: SocketAddr,
        /// Use UDP (a connected socket: send, expect the echo).
        #[arg(long)]
        udp: bool,
        /// Wait this long instead of for stdin (a runtime's exec gives the probe no stdin).
        #[arg(long)]
        for_secs: Option<u64>,
    },
    /// Print the answers of many getsockopt calls (see `capture_tests::sockopt_survey`) as JSON;
    /// runs as root (it sets supplementary groups).
    Sockopts,
    /// Open COUNT connections at once (round-robin over the --to addresses), print how many were
    /// established, hold them (see `capture_tests::flood::hold` for the stdin commands).
    Flood {
        #[arg(long, required = true)]
        to: Vec<SocketAddr>,
        #[arg(long)]
        count: usize,
        /// Connects in flight at once.
        #[arg(long, default_value_t = 512)]
        window: usize,
        /// A connect not established after this long counts as ETIMEDOUT. A connect waits
        /// behind the rest of its window (the limits tests size theirs with `flood::window_for`,
        /// whose slowest connect took 1.3 s in a starved emulated guest), so this is a bound
        /// for a stuck handshake, not a measure of the window.
        #[arg(long, default_value_t = 20_000)]
        patience_ms: u64,
    },
    /// A proxy that accepts every connection, reads its `SO_ORIGINAL_DST` and holds it; see
    /// `capture_tests::flood::sink` for its stdin commands.
    Sink {
        #[arg(long, required = true)]
        listen: Vec<SocketAddr>,
        #[arg(long, default_value_t = 4096)]
        backlog: i32,
        /// Accept only after a line `accept`.
        #[arg(long)]
        deferred: bool,
        /// `TCP_DEFER_ACCEPT`, in seconds: the kernel completes a connection on the listener's side
        /// only once data arrives, while the client's side is established already.
        #[arg(long)]
        defer_accept: Option<i32>,
        /// `SO_REUSEPORT`: one of several workers sharing the port.
        #[arg(long)]
        reuseport: bool,
    },
    /// Hold a new user namespace and a netns it owns until stdin ends (print `ready` once in).
    UsernsHolder,
    /// Print the cookie of the netns at `of` as capture's BPF reporter learns it (the way before
    /// Linux 5.14), from whichever namespaces this process runs in.
    NetnsCookie {
        #[arg(long)]
        of: PathBuf,
    },
    /// Do nothing until SIGTERM or SIGINT, reaping children meanwhile: a pod sandbox's pause
    /// process (the containerd tests' pause image runs it as PID 1).
    Pause,
    /// Istio's istio-validation check (`capture_tests::istio_validation)`: exit 0 when it
    /// passes, 1 with the reason when it does not.
    IstioValidation {
        /// The pod's address is IPv6: check on `::1` and `::6`.
        #[arg(long)]
        ipv6: bool,
        #[arg(long, default_value_t = 5)]
        timeout_secs: u64,
    },
    /// Print `ready`, then connect once per line of stdin (`{"to": ADDR, "udp": BOOL,
    /// "v6_socket": BOOL}`) and print each outcome as `connect` does, until stdin ends: many
    /// connects of one identity from one place without a process each (`capture_tests::probe::`
    /// Sessions).
    Session,
    /// Connect once and print the outcome.
    Connect {
        #[arg(long)]
        to: SocketAddr,
        /// Bind this source address first.
        #[arg(long)]
        bind: Option<SocketAddr>,
        /// Use UDP (connect, send, expect the echo).
        #[arg(long)]
        udp: bool,
        /// Create the socket as UID:GID, then switch to --uid/--gid before `connect()`.
        #[arg(long)]
        create_as: Option<String>,
        /// Use an IPv6 socket even for an IPv4-mapped destination.
        #[arg(long)]
        v6_socket: bool,
        /// Wait for a line on stdin before connecting.
        #[arg(long)]
        wait_stdin: bool,
        /// `IP_TRANSPARENT` on the socket (bind a non-local source, as original-source proxying does).
        #[arg(long)]
        transparent: bool,
        /// `SO_MARK` for the socket.
        #[arg(long)]
        mark: Option<u32>,
    },
}

mod serve;

use serve::{serve, set_transparent, ServeOptions};

fn die(msg: impl std::fmt::Display) -> ! {
    eprintln!("capture-probe: {msg}");
    std::process::exit(2)
}

fn check(rc: libc::c_int, what: &str) {
    if rc != 0 {
        die(format!("{what}: {}", std::io::Error::last_os_error()));
    }
}

fn become_ids(uid: u32, gid: u32, groups: &[u32]) {
    capture_tests::enter::become_ids(uid, gid, groups).unwrap_or_else(|e| die(e));
}

fn enter(args: &Args) {
    capture_tests::enter::join_pod(args.cgroup.as_deref(), args.netns.as_deref())
        .unwrap_or_else(|e| die(e));
    if let Some(userns) = &args.userns {
        capture_tests::enter::join_userns(userns).unwrap_or_else(|e| die(e));
    }
}

fn drop_privileges(args: &Args) {
    let real = (args.uid.unwrap_or(0), args.gid.unwrap_or(0));
    if let Some(spec) = &args.effective {
        let (u, g) = spec
            .split_once(':')
            .unwrap_or_else(|| die("--effective wants UID:GID"));
        let effective = (
            u.parse().unwrap_or_else(|e| die(e)),
            g.parse().unwrap_or_else(|e| die(e)),
        );
        capture_tests::enter::become_split_ids(real, effective, &args.groups)
            .unwrap_or_else(|e| die(e));
    } else if args.uid.is_some() || args.gid.is_some() {
        become_ids(real.0, real.1, &args.groups);
    }
}

fn new_socket(to: SocketAddr, udp: bool, v6_socket: bool) -> std::os::fd::OwnedFd {
    use nix::sys::socket::{socket, AddressFamily, SockFlag, SockType};
    let family = if to.is_ipv6() || v6_socket {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    let ty = if udp {
        SockType::Datagram
    } else {
        SockType::Stream
    };
    socket(family, ty, SockFlag::SOCK_CLOEXEC, None).unwrap_or_else(|e| die(e))
}

fn sockaddr_of(addr: SocketAddr, v6_socket: bool) -> nix::sys::socket::SockaddrStorage {
    match addr {
        SocketAddr::V4(a) if v6_socket => {
            SocketAddr::new(a.ip().to_ipv6_mapped().into(), a.port()).into()
        }
        other => other.into(),
    }
}

struct Tweaks {
    transparent: bool,
    mark: Option<u32>,
}

fn connect(
    args: &Args,
    to: SocketAddr,
    bind: Option<SocketAddr>,
    udp: bool,
    create_as: Option<&str>,
    v6_socket: bool,
    tweaks: &Tweaks,
) -> Value {
    use nix::sys::socket::{getpeername, getsockname, SockaddrStorage};
    if let Some(spec) = create_as {
        let (u, g) = spec
            .split_once(':')
            .unwrap_or_else(|| die("--create-as wants UID:GID"));
        become_ids(
            u.parse().unwrap_or_else(|e| die(e)),
            g.parse().unwrap_or_else(|e| die(e)),
            &[],
        );
    }
    let fd = new_socket(to, udp, v6_socket);
    if create_as.is_some() {
        drop_privileges(args);
    }
    if tweaks.transparent {
        set_transparent(&fd, to.is_ipv6() || v6_socket);
    }
    if let Some(mark) = tweaks.mark {
        nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::Mark, &mark)
            .unwrap_or_else(|e| die(format!("SO_MARK: {e}")));
    }
    if let Some(b) = bind {
        nix::sys::socket::bind(fd.as_raw_fd(), &sockaddr_of(b, v6_socket))
            .unwrap_or_else(|e| die(format!("bind {b}: {e}")));
    }
    let timeout = nix::sys::time::TimeVal::new(3, 0);
    let _ = nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::SendTimeout, &timeout);
    let _ = nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &timeout);
    if let Err(e) = nix::sys::socket::connect(fd.as_raw_fd(), &sockaddr_of(to, v6_socket)) {
        return json!({ "ok": false, "error": errno_name(&std::io::Error::from(e)) });
    }
    let show = |a: nix::Result<SockaddrStorage>| a.ok().map(|a| a.to_string());
    let local = show(getsockname(fd.as_raw_fd()));
    let peer = show(getpeername(fd.as_raw_fd()));
    let reply = if udp {
        let sock = UdpSocket::from(fd);
        if let Err(e) = sock.send(b"ping") {
            return json!({ "ok": false, "error": errno_name(&e), "local": local, "peer": peer });
        }
        let mut buf = [0u8; 1500];
        match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                let mut reply: Value = serde_json::from_slice(&buf[..n]).unwrap_or(Value::Null);
                // Where the reply came from, as the app sees it (DNS capture restores this).
                reply["reply_from"] = json!(from.to_string());
                reply
            }
            Err(e) => {
                return json!({ "ok": false, "error": errno_name(&e), "local": local, "peer": peer })
            }
        }
    } else {
        let mut stream = TcpStream::from(fd);
        let mut line = String::new();
        match BufReader::new(&mut stream).read_line(&mut line) {
            Ok(_) => serde_json::from_str(line.trim()).unwrap_or(Value::Null),
            Err(e) => {
                return json!({ "ok": false, "error": errno_name(&e), "local": local, "peer": peer })
            }
        }
    };
    json!({ "ok": true, "local": local, "peer": peer, "reply": reply })
}

/// Connects to `to` until a connection is served, as a proxy retries its first connection, and
/// says how long that took from this process's start.
fn dial_until_served(args: &Args, to: SocketAddr) {
    let start = std::time::Instant::now();
    let mut refused = 0;
    loop {
        let tweaks = Tweaks {
            transparent: false,
            mark: None,
        };
        let got = connect(args, to, None, false, None, false, &tweaks);
        if got["ok"] == true {
            println!(
                "first connection after {} ms ({refused} refused): {got}",
                start.elapsed().as_millis()
            );
            let _ = std::io::stdout().flush();
            return;
        }
        refused += 1;
        if start.elapsed() > Duration::from_mins(1) {
            die(format!("no connection to {to} in 60 s: {got}"));
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// One more exchange on an open socket: the server's fresh answer, and the peer as the app sees
/// it now.
fn ask_again(fd: &std::os::fd::OwnedFd, udp: bool) -> Value {
    use nix::sys::socket::{getpeername, SockaddrStorage};
    let peer = getpeername::<SockaddrStorage>(fd.as_raw_fd())
        .ok()
        .map(|a| a.to_string());
    let dup = fd.try_clone().unwrap_or_else(|e| die(e));
    if udp {
        let sock = UdpSocket::from(dup);
        if let Err(e) = sock.send(b"again") {
            return json!({ "ok": false, "error": errno_name(&e), "peer": peer });
        }
        let mut buf = [0u8; 1500];
        return match sock.recv_from(&mut buf) {
            Ok((n, from)) => {
                let mut reply: Value = serde_json::from_slice(&buf[..n]).unwrap_or(Value::Null);
                reply["reply_from"] = json!(from.to_string());
                json!({ "ok": true, "peer": peer, "reply": reply })
            }
            Err(e) => json!({ "ok": false, "error": errno_name(&e), "peer": peer }),
        };
    }
    let mut stream = TcpStream::from(dup);
    if let Err(e) = writeln!(stream, "again") {
        return json!({ "ok": false, "error": errno_name(&e), "peer": peer });
    }
    let mut line = String::new();
    match BufReader::new(&mut stream).read_line(&mut line) {
        Ok(n) if n > 0 => json!({
            "ok": true,
            "peer": peer,
            "reply": serde_json::from_str::<Value>(line.trim()).unwrap_or(Value::Null),
        }),
        Ok(_) => json!({ "ok": false, "error": "closed", "peer": peer }),
        Err(e) => json!({ "ok": false, "error": errno_name(&e), "peer": peer }),
    }
}

fn hold(to: SocketAddr, udp: bool, for_secs: Option<u64>) -> Value {
    use nix::sys::socket::{getpeername, SockaddrStorage};
    let fd = new_socket(to, udp, false);
    let timeout = nix::sys::time::TimeVal::new(5, 0);
    let _ = nix::sys::socket::setsockopt(&fd, nix::sys::socket::sockopt::ReceiveTimeout, &timeout);
    if let Err(e) = nix::sys::socket::connect(fd.as_raw_fd(), &sockaddr_of(to, false)) {
        return json!({ "ok": false, "error": errno_name(&std::io::Error::from(e)) });
    }
    let first = if udp {
        ask_again(&fd, true)
    } else {
        let mut stream = TcpStream::from(fd.try_clone().unwrap_or_else(|e| die(e)));
        let mut line = String::new();
        let _ = BufReader::new(&mut stream).read_line(&mut line);
        let peer = getpeername::<SockaddrStorage>(fd.as_raw_fd())
            .ok()
            .map(|a| a.to_string());
        json!({
            "ok": !line.is_empty(),
            "peer": peer,
            "reply": serde_json::from_str::<Value>(line.trim()).unwrap_or(Value::Null),
        })
    };
    if first["ok"] != json!(true) {
        return json!({ "ok": false, "first": first });
    }
    println!("ready");
    let _ = std::io::stdout().flush();
    if let Some(secs) = for_secs {
        std::thread::sleep(Duration::from_secs(secs));
    } else {
        let _ = std::io::stdin().read_line(&mut String::new());
    }
    let second = ask_again(&fd, udp);
    json!({ "ok": true, "first": first, "second": second })
}

#[expect(
    clippy::too_many_lines,
    reason = "one arm per probe command, each beside the arguments it reads; a test tool"
)]
fn main() {
    let args = Args::parse();
    enter(&args);
    match &args.cmd {
        Cmd::Serve {
            tcp,
            udp,
            transparent,
            reuseport,
            dual_stack,
            dial_first,
        } => {
            drop_privileges(&args);
            if let Some(to) = dial_first {
                dial_until_served(&args, *to);
            }
            serve(
                tcp,
                udp,
                ServeOptions {
                    transparent: *transparent,
                    reuseport: *reuseport,
                    dual_stack: *dual_stack,
                },
            )
        }
        Cmd::Flood {
            to,
            count,
            window,
            patience_ms,
        } => {
            use capture_tests::flood;
            flood::raise_open_files().unwrap_or_else(|e| die(format!("setrlimit: {e}")));
            drop_privileges(&args);
            let report = flood::flood(to, *count, *window, Duration::from_millis(*patience_ms))
                .unwrap_or_else(|e| die(format!("flood: {e}")));
            println!("{}", report.to_json(*count));
            let _ = std::io::stdout().flush();
            flood::hold(report.established).unwrap_or_else(|e| die(format!("flood: {e}")));
        }
        Cmd::Sink {
            listen,
            backlog,
            deferred,
            defer_accept,
            reuseport,
        } => {
            use capture_tests::flood;
            flood::raise_open_files().unwrap_or_else(|e| die(format!("setrlimit: {e}")));
            drop_privileges(&args);
            flood::sink(
                listen,
                &flood::SinkOptions {
                    backlog: *backlog,
                    deferred: *deferred,
                    reuseport: *reuseport,
                    defer_accept: *defer_accept,
                },
            )
            .unwrap_or_else(|e| die(format!("sink: {e}")));
        }
        Cmd::UsernsHolder => {
            capture_tests::enter::unshare_user_and_net().unwrap_or_else(|e| die(e));
            println!("ready");
            let _ = std::io::stdout().flush();
            let _ = std::io::stdin().read_to_end(&mut Vec::new());
        }
        Cmd::Sockopts => println!("{}", capture_tests::sockopt_survey::survey()),
        Cmd::NetnsCookie { of } => {
            let netns = std::fs::File::open(of)
                .unwrap_or_else(|e| die(format!("opening {}: {e}", of.display())));
            match capture_user::ebpf::netns_cookie::netns_cookie(&netns) {
                Ok(cookie) => println!("{cookie}"),
                Err(e) => die(format!("the netns-cookie reporter: {e}")),
            }
        }
        Cmd::IstioValidation { ipv6, timeout_secs } => {
            drop_privileges(&args);
            match capture_tests::istio_validation::validate(
                *ipv6,
                Duration::from_secs(*timeout_secs),
            ) {
                Ok(()) => std::process::exit(0),
                Err(why) => {
                    eprintln!("istio-validation: {why}");
                    std::process::exit(1)
                }
            }
        }
        Cmd::Pause => {
            drop_privileges(&args);
            let Err(e) = capture_tests::pause::pause();
            die(e)
        }
        Cmd::Hold { to, udp, for_secs } => {
            drop_privileges(&args);
            let out = hold(*to, *udp, *for_secs);
            println!("{out}");
        }
        Cmd::Exec { argv } => {
            use std::os::unix::process::CommandExt as _;
            drop_privileges(&args);
            let err = std::process::Command::new(&argv[0]).args(&argv[1..]).exec();
            die(format!("exec {}: {err}", argv[0]))
        }
        Cmd::Session => {
            drop_privileges(&args);
            println!("ready");
            let _ = std::io::stdout().flush();
            for line in std::io::stdin().lock().lines().map_while(Result::ok) {
                let request: Value =
                    serde_json::from_str(&line).unwrap_or_else(|e| die(format!("{line}: {e}")));
                let to = request["to"]
                    .as_str()
                    .and_then(|t| t.parse().ok())
                    .unwrap_or_else(|| die(format!("{line}: no destination")));
                let flag = |name: &str| request[name].as_bool().unwrap_or(false);
                let out = connect(
                    &args,
                    to,
                    None,
                    flag("udp"),
                    None,
                    flag("v6_socket"),
                    &Tweaks {
                        transparent: false,
                        mark: None,
                    },
                );
                println!("{out}");
                let _ = std::io::stdout().flush();
            }
        }
        Cmd::Connect {
            to,
            bind,
            udp,
            create_as,
            v6_socket,
            wait_stdin,
            transparent,
            mark,
        } => {
            if *wait_stdin {
                println!("waiting");
                let _ = std::io::stdout().flush();
                let mut b = [0u8; 1];
                let _ = std::io::stdin().read(&mut b);
            }
            if create_as.is_none() {
                drop_privileges(&args);
            }
            let tweaks = Tweaks {
                transparent: *transparent,
                mark: *mark,
            };
            let out = connect(
                &args,
                *to,
                *bind,
                *udp,
                create_as.as_deref(),
                *v6_socket,
                &tweaks,
            );
            println!("{out}");
        }
    }
}
