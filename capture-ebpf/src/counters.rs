//! Per-pod and node-wide counters.

use capture_common::config::{NodeError, PodCounter};

use crate::maps::{NODE_ERRORS, POD_COUNTERS};

/// Bumps one of the pod's counters (per CPU, so no atomics are needed).
#[inline(always)]
pub fn bump_pod(netns_cookie: u64, which: PodCounter) {
    if let Some(p) = POD_COUNTERS.get_ptr_mut(netns_cookie) {
        // SAFETY: the pointer is this CPU's slot of the entry; nothing else writes it concurrently.
        unsafe { (*p).bump(which) };
    }
}

#[inline(always)]
pub fn bump_node(kind: NodeError) {
    if let Some(p) = NODE_ERRORS.get_ptr_mut(kind as u32) {
        // SAFETY: as above, a per-CPU slot.
        unsafe { *p += 1 };
    }
}
