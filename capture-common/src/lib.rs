//! Types shared by capture's kernel programs and its user space.
//!
//! Everything here is `#[repr(C)]` with explicit padding and a size assertion, because the kernel
//! programs and user space exchange these values through BPF maps byte for byte. The outbound
//! decision procedure also lives here, so that the kernel runs exactly the code that the unit tests
//! exercise on the host.
#![no_std]

pub mod accel;
pub mod addr;
pub mod adopt;
pub mod config;
pub mod decision;
pub mod keys;
pub mod layout;
pub mod loopback;
pub mod state;
pub mod trace;
pub mod verdict;

/// `AF_INET`, as the kernel and `sockaddr` spell it.
pub const AF_INET: u16 = 2;
/// `AF_INET6`.
pub const AF_INET6: u16 = 10;

/// `SOCK_STREAM`, as `bpf_sock::type_` holds it.
pub const SOCK_STREAM: u32 = 1;
/// `SOCK_DGRAM`.
pub const SOCK_DGRAM: u32 = 2;

/// `SO_ORIGINAL_DST` (`SOL_IP`) and `IP6T_SO_ORIGINAL_DST` (`SOL_IPV6`) share the number 80.
pub const SO_ORIGINAL_DST: i32 = 80;
pub const SOL_IP: i32 = 0;
pub const SOL_IPV6: i32 = 41;

/// Lets user space put these types in aya maps. Sound because every type is `#[repr(C)]`, `Copy`,
/// and has no implicit padding (the size assertions next to each type pin that down).
#[cfg(feature = "user")]
mod user {
    use crate::{config, keys, state, trace};

    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for trace::TraceLease {}

    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for config::PodConfig {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for config::PodCounters {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for config::AccelCounters {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::PortKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::CidrKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::HandoffKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::PodAddrKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::ListenerKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for keys::LoopbackKey {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for state::OriginalDst {}
    // SAFETY: repr(C), Copy, no implicit padding (its size assertion).
    unsafe impl aya::Pod for state::SockState {}
}
