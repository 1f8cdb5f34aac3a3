//! `sockaddr_in` / `sockaddr_in6` as the kernel lays them out (bpf_bind takes them, and
//! `SO_ORIGINAL_DST` returns them).

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
