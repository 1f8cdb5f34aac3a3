//! Socket-local state: who created a socket, where it was going before capture rewrote it, and
//! how an accelerated socket reaches its peer.

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE, cty::c_void, helpers::generated::bpf_sk_storage_get,
};
use capture_common::state::{AccelState, SockState};

use crate::maps::{SocketStorage, ACCEL_STATES, SOCKET_STATES};

#[inline(always)]
fn lookup<T, const FLAGS: usize>(
    map: &SocketStorage<T, FLAGS>,
    sk: *mut c_void,
    create: bool,
) -> Option<&'static mut T> {
    let flags = if create {
        u64::from(BPF_SK_STORAGE_GET_F_CREATE)
    } else {
        0
    };
    // SAFETY: `sk` is a full socket pointer from the program context; the helper returns either
    // null or a pointer to this socket's `T` (zeroed when just created), which lives as long as
    // the socket.
    unsafe {
        let p = bpf_sk_storage_get(map.as_ptr(), sk, core::ptr::null_mut(), flags);
        p.cast::<T>().as_mut()
    }
}

/// The state of socket `sk`, if any was recorded.
#[inline(always)]
pub fn get(sk: *mut c_void) -> Option<&'static mut SockState> {
    lookup(&SOCKET_STATES, sk, false)
}

/// The state of socket `sk`, created zeroed if it has none. `None` only when the kernel cannot
/// allocate it.
#[inline(always)]
pub fn get_or_create(sk: *mut c_void) -> Option<&'static mut SockState> {
    lookup(&SOCKET_STATES, sk, true)
}

/// The acceleration state of socket `sk`, if it joined `ACCEL_PEERS`.
#[inline(always)]
pub fn accel(sk: *mut c_void) -> Option<&'static mut AccelState> {
    lookup(&ACCEL_STATES, sk, false)
}

/// The acceleration state of socket `sk`, created zeroed if it has none.
#[inline(always)]
pub fn accel_or_create(sk: *mut c_void) -> Option<&'static mut AccelState> {
    lookup(&ACCEL_STATES, sk, true)
}
