//! Network namespaces: open and verify a netns path, learn its cookie, run code inside it.

use std::{
    fs::File,
    io::{self, Write as _},
    os::fd::AsRawFd as _,
    path::{Path, PathBuf},
    process::{Command, Output, Stdio},
};

use nix::sched::{setns, CloneFlags};

/// How to learn a netns's cookie where `SO_NETNS_COOKIE` is missing (before Linux 5.14): only a
/// BPF program can tell it there, so the ebpf backend provides this
/// (`capture-user/src/ebpf/netns_cookie.rs`).
pub type CookieFallback = fn(&File) -> io::Result<u64>;

#[derive(Debug, thiserror::Error)]
pub enum NetnsError {
    #[error(
        "netns {path}: {source}; pass a netns file such as /var/run/netns/NAME or /proc/PID/ns/net"
    )]
    Open { path: PathBuf, source: io::Error },
    #[error("netns {path} is not a network namespace; pass a netns file such as /var/run/netns/NAME or /proc/PID/ns/net")]
    NotNetns { path: PathBuf },
    #[error("netns {path}: cannot enter it: {source}")]
    Enter { path: PathBuf, source: nix::Error },
    #[error("netns {path}: cannot learn its netns cookie: {source}")]
    Cookie { path: PathBuf, source: io::Error },
}

/// `NS_GET_NSTYPE` (`_IO(0xb7, 0x3)`).
const NS_GET_NSTYPE: libc::c_ulong = 0xb703;
/// `SO_NETNS_COOKIE`.
const SO_NETNS_COOKIE: libc::c_int = 71;

/// An open network namespace.
#[derive(Debug)]
pub struct Netns {
    file: File,
    path: PathBuf,
}

impl Netns {
    /// Opens the netns at `path`. A runtime's `/proc/<pid>/ns/net` names the node's pid, so it is
    /// opened under the node's /proc (`paths::on_node`); `path` is kept as given.
    pub fn open(path: &Path) -> Result<Self, NetnsError> {
        let reached = crate::paths::on_node(path);
        let file = File::open(&reached).map_err(|source| NetnsError::Open {
            path: reached.clone(),
            source,
        })?;
        // SAFETY: NS_GET_NSTYPE takes no argument and only reads the fd.
        let ns_type = unsafe { libc::ioctl(file.as_raw_fd(), NS_GET_NSTYPE) };
        if ns_type != libc::CLONE_NEWNET {
            return Err(NetnsError::NotNetns { path: path.into() });
        }
        Ok(Self {
            file,
            path: path.into(),
        })
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    #[must_use]
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Runs `f` on a thread that has entered this netns (only that thread moves).
    pub fn run_in<T: Send>(&self, f: impl FnOnce() -> T + Send) -> Result<T, NetnsError> {
        std::thread::scope(|s| {
            s.spawn(|| {
                setns(&self.file, CloneFlags::CLONE_NEWNET).map_err(|source| {
                    NetnsError::Enter {
                        path: self.path.clone(),
                        source,
                    }
                })?;
                Ok(f())
            })
            .join()
            .expect("netns thread panicked")
        })
    }

    /// The kernel's cookie for this netns: what the kernel programs key the pod by. Asked with
    /// `SO_NETNS_COOKIE`, or, on kernels without it (before Linux 5.14), of `fallback`.
    pub fn cookie(&self, fallback: CookieFallback) -> Result<u64, NetnsError> {
        let cookie = match self.run_in(netns_cookie_here)? {
            Err(e) if e.raw_os_error() == Some(libc::ENOPROTOOPT) => fallback(&self.file),
            asked => asked,
        };
        cookie.map_err(|source| NetnsError::Cookie {
            path: self.path.clone(),
            source,
        })
    }
}

/// Runs `cmd` to completion inside the netns at `path`, with `stdin` as its input: it is spawned
/// from a thread that entered the netns, so it starts there and nothing else moves. A netns that
/// belongs to a user namespace of its own is entered with it: the kernel takes some writes (an
/// iptables owner match) only from a writer in the netns's user namespace.
pub fn output_in(path: &Path, cmd: &mut Command, stdin: &[u8]) -> io::Result<Output> {
    let netns = Netns::open(path).map_err(io::Error::other)?;
    let userns = crate::userns::owner_of(netns.file()).map_err(io::Error::other)?;
    if let Some(userns) = &userns {
        crate::userns::run_inside(cmd, userns);
    }
    netns
        .run_in(|| {
            let mut child = cmd
                .stdin(Stdio::piped())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()?;
            child.stdin.take().expect("piped").write_all(stdin)?;
            child.wait_with_output()
        })
        .map_err(io::Error::other)?
}

/// How this process learns netns cookies here, for `capture doctor`.
pub fn describe_cookie_source(fallback: CookieFallback) -> Result<String, String> {
    if netns_cookie_here().is_ok() {
        return Ok("SO_NETNS_COOKIE".into());
    }
    let own = Netns::open(Path::new("/proc/self/ns/net")).map_err(|e| e.to_string())?;
    fallback(own.file())
        .map(|_| {
            "through a cgroup/sock_create program (no SO_NETNS_COOKIE before Linux 5.14)".into()
        })
        .map_err(|e| e.to_string())
}

/// The cookie of the calling thread's netns.
pub fn netns_cookie_here() -> io::Result<u64> {
    // SAFETY: plain socket/getsockopt/close calls with a correctly sized out-buffer.
    unsafe {
        let fd = libc::socket(libc::AF_UNIX, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut cookie: u64 = 0;
        let mut len = size_of::<u64>() as libc::socklen_t;
        let rc = libc::getsockopt(
            fd,
            libc::SOL_SOCKET,
            SO_NETNS_COOKIE,
            (&raw mut cookie).cast(),
            &raw mut len,
        );
        let err = io::Error::last_os_error();
        libc::close(fd);
        if rc != 0 {
            return Err(err);
        }
        Ok(cookie)
    }
}

/// Sets `lo` up in the calling thread's netns (a new netns has its loopback down).
pub fn set_loopback_up() -> io::Result<()> {
    // SAFETY: an ioctl on a fresh socket with an ifreq naming lo.
    unsafe {
        let fd = libc::socket(libc::AF_INET, libc::SOCK_DGRAM, 0);
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        let mut req: libc::ifreq = std::mem::zeroed();
        req.ifr_name[..2].copy_from_slice(&[b'l' as libc::c_char, b'o' as libc::c_char]);
        let rc = if libc::ioctl(fd, libc::SIOCGIFFLAGS, &mut req) == 0 {
            req.ifr_ifru.ifru_flags |= libc::IFF_UP as i16;
            libc::ioctl(fd, libc::SIOCSIFFLAGS, &req)
        } else {
            -1
        };
        let err = io::Error::last_os_error();
        libc::close(fd);
        if rc != 0 {
            return Err(err);
        }
    }
    Ok(())
}
