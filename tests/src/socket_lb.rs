//! A network plugin's socket load balancer, as Cilium's kube-proxy replacement runs one: a
//! cgroup connect4 program at the top of the pods' cgroup tree that turns a service address into
//! a backend's before the connection leaves the socket. Hand-assembled (eleven instructions), so
//! the tests need no second BPF object to show how capture coexists with one.

use std::{
    io,
    net::SocketAddrV4,
    os::fd::{AsFd as _, FromRawFd as _, OwnedFd},
    path::Path,
};

use capture_user::ebpf::sys;

const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_PROG_TYPE_CGROUP_SOCK_ADDR: u32 = 18;
const BPF_CGROUP_INET4_CONNECT: u32 = 10;
/// The name the kernel keeps for it (what `capture doctor` shows).
pub const PROGRAM_NAME: &str = "test_socket_lb";

/// One instruction: opcode, registers (source in the high nibble), offset, immediate.
fn insn(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> [u8; 8] {
    let mut b = [0u8; 8];
    b[0] = code;
    b[1] = (src << 4) | dst;
    b[2..4].copy_from_slice(&off.to_le_bytes());
    b[4..8].copy_from_slice(&imm.to_le_bytes());
    b
}

/// `user_ip4` and `user_port` in `struct bpf_sock_addr`, both in network order.
const USER_IP4: i16 = 4;
const USER_PORT: i16 = 24;

/// The program: `connect()` to `service` goes to `backend` instead; everything else passes.
fn program(service: SocketAddrV4, backend: SocketAddrV4) -> Vec<u8> {
    let ip = |a: &SocketAddrV4| i32::from_ne_bytes(a.ip().octets());
    let port = |a: &SocketAddrV4| i32::from(u16::from_ne_bytes(a.port().to_be_bytes()));
    [
        insn(0xbf, 6, 1, 0, 0),              // r6 = r1 (the context)
        insn(0x61, 2, 6, USER_IP4, 0),       // r2 = ctx->user_ip4
        insn(0x56, 2, 0, 6, ip(&service)),   // if w2 != service ip: goto pass
        insn(0x61, 2, 6, USER_PORT, 0),      // r2 = ctx->user_port
        insn(0x56, 2, 0, 4, port(&service)), // if w2 != service port: goto pass
        insn(0xb4, 2, 0, 0, ip(&backend)),   // w2 = backend ip
        insn(0x63, 6, 2, USER_IP4, 0),       // ctx->user_ip4 = w2
        insn(0xb4, 2, 0, 0, port(&backend)), // w2 = backend port
        insn(0x63, 6, 2, USER_PORT, 0),      // ctx->user_port = w2
        insn(0xb7, 0, 0, 0, 1),              // pass: r0 = 1 (allow)
        insn(0x95, 0, 0, 0, 0),              // exit
    ]
    .concat()
}

/// The load balancer, attached to a cgroup until dropped (its link is not pinned).
pub struct SocketLb {
    _link: OwnedFd,
}

impl SocketLb {
    /// Loads the program and links it to `cgroup`'s connect4 hook.
    pub fn attach(cgroup: &Path, service: SocketAddrV4, backend: SocketAddrV4) -> io::Result<Self> {
        // Before 5.11 a program's memory counts against RLIMIT_MEMLOCK, compared with all that
        // root has locked (the agents' maps among it): without this, 5.10 says EPERM. Later
        // kernels do not look, and where the limit cannot be raised (no CAP_SYS_RESOURCE) the
        // load says so itself.
        let unlimited = libc::rlimit {
            rlim_cur: libc::RLIM_INFINITY,
            rlim_max: libc::RLIM_INFINITY,
        };
        // SAFETY: a plain setrlimit call with a valid struct.
        let _ = unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const unlimited) };
        let insns = program(service, backend);
        let license = c"GPL";
        let mut log = vec![0u8; 65536];
        let mut attr = [0u8; 128];
        attr[0..4].copy_from_slice(&BPF_PROG_TYPE_CGROUP_SOCK_ADDR.to_ne_bytes());
        attr[4..8].copy_from_slice(&((insns.len() / 8) as u32).to_ne_bytes());
        attr[8..16].copy_from_slice(&(insns.as_ptr() as u64).to_ne_bytes());
        attr[16..24].copy_from_slice(&(license.as_ptr() as u64).to_ne_bytes());
        attr[24..28].copy_from_slice(&1u32.to_ne_bytes());
        attr[28..32].copy_from_slice(&(log.len() as u32).to_ne_bytes());
        attr[32..40].copy_from_slice(&(log.as_mut_ptr() as u64).to_ne_bytes());
        attr[48..48 + PROGRAM_NAME.len()].copy_from_slice(PROGRAM_NAME.as_bytes());
        attr[68..72].copy_from_slice(&BPF_CGROUP_INET4_CONNECT.to_ne_bytes());
        // SAFETY: `attr` is a zero-padded bpf_attr for BPF_PROG_LOAD whose pointers outlive the call.
        let fd =
            unsafe { libc::syscall(libc::SYS_bpf, BPF_PROG_LOAD, attr.as_mut_ptr(), attr.len()) };
        if fd < 0 {
            let e = io::Error::last_os_error();
            let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
            return Err(io::Error::new(
                e.kind(),
                format!(
                    "loading: {e}; verifier: {}",
                    String::from_utf8_lossy(&log[..end])
                ),
            ));
        }
        // SAFETY: a new fd that nothing else owns.
        let prog = unsafe { OwnedFd::from_raw_fd(fd as i32) };
        let target = std::fs::File::open(cgroup)?;
        let link = sys::link_create(prog.as_fd(), target.as_fd(), BPF_CGROUP_INET4_CONNECT)
            .map_err(|e| {
                io::Error::new(e.kind(), format!("linking to {}: {e}", cgroup.display()))
            })?;
        Ok(Self { _link: link })
    }
}
