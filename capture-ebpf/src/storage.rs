//! Socket-local state: who created a socket, and where it was going before capture rewrote it.

use aya_ebpf::{
    bindings::BPF_SK_STORAGE_GET_F_CREATE, cty::c_void, helpers::generated::bpf_sk_storage_get,
};
use capture_common::state::SockState;

use crate::maps::SOCKET_STATES;

/// The state of socket `sk`, if any was recorded.
#[inline(always)]
pub fn get(sk: *mut c_void) -> Option<&'static mut SockState> {
    // SAFETY: `sk` is a full socket pointer from the program context; the helper returns either
    // null or a pointer to this socket's `SockState`, which lives as long as the socket.
    unsafe {
        let p = bpf_sk_storage_get(SOCKET_STATES.as_ptr(), sk, core::ptr::null_mut(), 0);
        p.cast::<SockState>().as_mut()
    }
}

/// The state of socket `sk`, created zeroed if it has none. `None` only when the kernel cannot
/// allocate it.
#[inline(always)]
pub fn get_or_create(sk: *mut c_void) -> Option<&'static mut SockState> {
    // SAFETY: as for `get`; with the create flag the kernel allocates a zeroed entry.
    unsafe {
        let p = bpf_sk_storage_get(
            SOCKET_STATES.as_ptr(),
            sk,
            core::ptr::null_mut(),
            u64::from(BPF_SK_STORAGE_GET_F_CREATE),
        );
        p.cast::<SockState>().as_mut()
    }
}
