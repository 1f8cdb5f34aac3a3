//! The socket-local storage map's declaration, shared by the node's object and the listener
//! adopter's (which uses the node's pinned map).

use aya_ebpf::bindings::{bpf_map_type::BPF_MAP_TYPE_SK_STORAGE, BPF_F_CLONE, BPF_F_NO_PREALLOC};
use capture_common::state::SockState;

/// Socket-local storage. Declared by hand rather than with `btf_maps::SkStorage` because it needs
/// `BPF_F_CLONE`: a listener's entry (its netns cookie) is copied into every socket it accepts.
#[repr(C)]
pub struct SocketStates {
    r#type: *const [i32; BPF_MAP_TYPE_SK_STORAGE as usize],
    key: *const i32,
    value: *const SockState,
    max_entries: *const [i32; 0],
    map_flags: *const [i32; (BPF_F_NO_PREALLOC | BPF_F_CLONE) as usize],
}

// SAFETY: the fields are type-only placeholders the loader reads from BTF; nothing dereferences them.
unsafe impl Sync for SocketStates {}

impl SocketStates {
    pub const fn new() -> Self {
        Self {
            r#type: core::ptr::null(),
            key: core::ptr::null(),
            value: core::ptr::null(),
            max_entries: core::ptr::null(),
            map_flags: core::ptr::null(),
        }
    }

    /// The map reference the helpers take; the loader relocates the symbol to the map's fd.
    #[inline(always)]
    pub fn as_ptr(&self) -> *mut core::ffi::c_void {
        core::ptr::from_ref(self).cast_mut().cast()
    }
}
