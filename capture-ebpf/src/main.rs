//! capture's kernel programs. Loaded once per node, attached per pod (its cgroup), configured per
//! pod through maps keyed by the pod's netns cookie.
//!
//! Each entry point is thin: it calls the module that does the work and maps the outcome to the
//! hook's verdict. Verdicts: `sock_addr` and sockopt programs return 1 to let the call proceed and 0
//! to refuse it (EPERM).
#![no_std]
#![no_main]

mod accel;
mod connect;
mod counters;
mod creator;
mod ends;
mod lookup;
mod loopback;
mod maps;
mod peer;
mod rodata;
mod sock;
mod sockaddr;
mod socket_states;
mod sockops;
mod sockopt;
mod storage;
mod trace;

use aya_ebpf::{
    macros::{cgroup_sock, cgroup_sock_addr, cgroup_sockopt, sk_lookup, sk_msg, sock_ops},
    programs::{
        SkLookupContext, SkMsgContext, SockAddrContext, SockContext, SockOpsContext, SockoptContext,
    },
};

/// The object's license, as the kernel reads it. GPL-compatible: the owner-from-file and
/// stateless-redirect programs read kernel structures through BTF pointers, which the verifier
/// allows GPL-compatible programs only (without it they fail to load, and the loader falls back
/// to the paths that do without them). The kernel crates are MIT OR GPL-2.0 (Cargo.toml).
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

const PROCEED: i32 = 1;
const REFUSE: i32 = 0;

#[inline(always)]
fn connect_verdict(result: Result<(), connect::ConnectError>) -> i32 {
    match result {
        Ok(()) => PROCEED,
        Err(e) => {
            connect::record_refusal(&e);
            REFUSE
        }
    }
}

#[cgroup_sock_addr(connect4)]
pub fn capture_connect4(ctx: SockAddrContext) -> i32 {
    connect_verdict(connect::try_outbound4(&ctx, connect::Call::Connect))
}

#[cgroup_sock_addr(connect6)]
pub fn capture_connect6(ctx: SockAddrContext) -> i32 {
    connect_verdict(connect::try_outbound6(&ctx, connect::Call::Connect))
}

#[cgroup_sock_addr(sendmsg4)]
pub fn capture_sendmsg4(ctx: SockAddrContext) -> i32 {
    connect_verdict(connect::try_outbound4(&ctx, connect::Call::Sendmsg))
}

#[cgroup_sock_addr(sendmsg6)]
pub fn capture_sendmsg6(ctx: SockAddrContext) -> i32 {
    connect_verdict(connect::try_outbound6(&ctx, connect::Call::Sendmsg))
}

#[cgroup_sock_addr(recvmsg4)]
pub fn capture_recvmsg4(ctx: SockAddrContext) -> i32 {
    peer::on_recvmsg4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(recvmsg6)]
pub fn capture_recvmsg6(ctx: SockAddrContext) -> i32 {
    peer::on_recvmsg6(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername4)]
pub fn capture_getpeername4(ctx: SockAddrContext) -> i32 {
    peer::on_getpeername4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getpeername6)]
pub fn capture_getpeername6(ctx: SockAddrContext) -> i32 {
    peer::on_getpeername6(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getsockname4)]
pub fn capture_getsockname4(ctx: SockAddrContext) -> i32 {
    peer::on_getsockname4(&ctx);
    PROCEED
}

#[cgroup_sock_addr(getsockname6)]
pub fn capture_getsockname6(ctx: SockAddrContext) -> i32 {
    peer::on_getsockname6(&ctx);
    PROCEED
}

#[cgroup_sock(sock_create)]
pub fn capture_sock_create(ctx: SockContext) -> i32 {
    sock::on_sock_create(&ctx);
    PROCEED
}

#[sock_ops]
pub fn capture_sock_ops(ctx: SockOpsContext) -> u32 {
    sockops::on_sock_ops(&ctx);
    0
}

#[cgroup_sockopt(getsockopt)]
pub fn capture_getsockopt(ctx: SockoptContext) -> i32 {
    if sockopt::on_getsockopt(&ctx) {
        PROCEED
    } else {
        REFUSE
    }
}

#[sk_lookup]
pub fn capture_sk_lookup(ctx: SkLookupContext) -> u32 {
    lookup::on_sk_lookup(&ctx)
}

/// Attached to `ACCEL_PEERS`, not to a pod: runs for every write of an accelerated socket.
#[sk_msg]
pub fn capture_accel_msg(ctx: SkMsgContext) -> u32 {
    accel::on_msg(&ctx)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
