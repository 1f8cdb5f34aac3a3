//! `sockaddr_in` / `sockaddr_in6` as the kernel lays them out (bpf_bind takes them, and
//! `SO_ORIGINAL_DST` returns them), and the sock_addr programs' view of the address a call
//! carries.

use aya_ebpf::{bindings::bpf_sock_addr, programs::SockAddrContext};

#[repr(C)]
pub struct SockaddrIn {
    pub family: u16,
    /// Network order.
    pub port: u16,
    /// Network order.
    pub addr: u32,
    pub zero: [u8; 8],
}

#[repr(C)]
pub struct SockaddrIn6 {
    pub family: u16,
    /// Network order.
    pub port: u16,
    pub flowinfo: u32,
    /// Network order.
    pub addr: [u32; 4],
    pub scope_id: u32,
}

/// The sock_addr program's context: the address the call carries, which the program may rewrite.
#[inline(always)]
#[expect(
    clippy::mut_from_ref,
    reason = "the context wraps the kernel's raw pointer; the program is its only user"
)]
pub fn sock_addr(ctx: &SockAddrContext) -> &mut bpf_sock_addr {
    // SAFETY: the context pointer is valid for the whole program run.
    unsafe { &mut *ctx.sock_addr }
}
