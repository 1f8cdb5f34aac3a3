//! Constants the loader writes into `.rodata` before the object loads (feature switches, struct
//! offsets). The verifier sees their values, so a switched-off branch is never visited.

/// The value the loader wrote: read volatile, so that the compiler keeps the read rather than
/// folding in the default the source gives.
#[inline(always)]
pub fn constant<T: Copy>(value: &'static T) -> T {
    // SAFETY: a read of a static.
    unsafe { core::ptr::read_volatile(value) }
}
