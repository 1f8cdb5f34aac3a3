//! `sockaddr_in` / `sockaddr_in6` as the kernel lays them out (`bpf_bind` takes them, and
//! `SO_ORIGINAL_DST` returns them), and the `sock_addr` programs' view of the address a call
//! carries.

use aya_ebpf::{
    bindings::{bpf_sock, bpf_sock_addr},
    programs::SockAddrContext,
};

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

/// The address a `sock_addr` program's call carries, which the program may rewrite. Read and
/// written field by field through the kernel's pointer, never as a Rust reference: two live
/// `&mut` to the same context would be unsound even where the generated code is the same.
#[derive(Clone, Copy)]
pub struct SockAddr(*mut bpf_sock_addr);

/// The context's address.
#[inline(always)]
pub fn sock_addr(ctx: &SockAddrContext) -> SockAddr {
    SockAddr(ctx.sock_addr)
}

// In every method: the pointer is the kernel's context, valid for the whole program run; each
// access is a place expression on it (no reference is made), of the field's own size, as the
// verifier requires of context accesses.
impl SockAddr {
    /// The calling socket (`sk` is the union's only pointer member in `sock_addr` programs).
    #[inline(always)]
    pub fn sk(self) -> *mut bpf_sock {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).__bindgen_anon_1.sk }
    }

    /// `SOCK_STREAM` or `SOCK_DGRAM`.
    #[inline(always)]
    pub fn sock_type(self) -> u32 {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).type_ }
    }

    /// Network order.
    #[inline(always)]
    pub fn user_ip4(self) -> u32 {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).user_ip4 }
    }

    #[inline(always)]
    pub fn set_user_ip4(self, addr: u32) {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).user_ip4 = addr }
    }

    /// Network order, word by word (the verifier accepts only 4-byte accesses there).
    #[inline(always)]
    pub fn user_ip6(self) -> [u32; 4] {
        // SAFETY: the context pointer, as above.
        unsafe {
            [
                (*self.0).user_ip6[0],
                (*self.0).user_ip6[1],
                (*self.0).user_ip6[2],
                (*self.0).user_ip6[3],
            ]
        }
    }

    #[inline(always)]
    pub fn set_user_ip6(self, addr: [u32; 4]) {
        // SAFETY: the context pointer, as above.
        unsafe {
            (*self.0).user_ip6[0] = addr[0];
            (*self.0).user_ip6[1] = addr[1];
            (*self.0).user_ip6[2] = addr[2];
            (*self.0).user_ip6[3] = addr[3];
        }
    }

    /// The port in network order, in the low half of the word.
    #[inline(always)]
    pub fn user_port(self) -> u32 {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).user_port }
    }

    /// `port` in host order.
    #[inline(always)]
    pub fn set_port(self, port: u16) {
        // SAFETY: the context pointer, as above.
        unsafe { (*self.0).user_port = u32::from(port.to_be()) }
    }
}
