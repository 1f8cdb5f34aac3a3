//! IP addresses as the kernel hands them to programs: four network-order words, an IPv4 address
//! in word 0, or in word 3 of a v4-mapped IPv6 address (`::ffff:a.b.c.d`). One set of helpers for
//! the decision procedure and every program.

/// An IPv4 address in network order, as `bpf_sock_addr::user_ip4` holds it.
#[inline(always)]
#[must_use]
pub const fn ip4(a: u8, b: u8, c: u8, d: u8) -> u32 {
    u32::from_ne_bytes([a, b, c, d])
}

/// Word 2 of a v4-mapped IPv6 address.
pub const V4_MAPPED_PREFIX: u32 = ip4(0, 0, 0xff, 0xff);

/// Whether two addresses are the same, word by word.
#[inline(always)]
#[must_use]
pub fn same(a: &[u32; 4], b: &[u32; 4]) -> bool {
    a[0] == b[0] && a[1] == b[1] && a[2] == b[2] && a[3] == b[3]
}

/// `0.0.0.0` or `::` (a wildcard bind).
#[inline(always)]
#[must_use]
pub fn is_unspecified(a: &[u32; 4]) -> bool {
    same(a, &[0; 4])
}

/// The IPv4 address inside a v4-mapped IPv6 address, if it is one.
#[inline(always)]
#[must_use]
pub fn unmap(a: &[u32; 4]) -> Option<u32> {
    (a[0] == 0 && a[1] == 0 && a[2] == V4_MAPPED_PREFIX).then_some(a[3])
}

/// `::ffff:addr4`.
#[inline(always)]
#[must_use]
pub const fn v4_mapped(addr4: u32) -> [u32; 4] {
    [0, 0, V4_MAPPED_PREFIX, addr4]
}

/// Inside 127.0.0.0/8.
#[inline(always)]
#[must_use]
pub const fn is_loopback4(addr: u32) -> bool {
    u32::from_be(addr) >> 24 == 127
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mapped_addresses_round_trip() {
        let a = ip4(10, 1, 0, 10);
        assert_eq!(unmap(&v4_mapped(a)), Some(a));
        assert_eq!(unmap(&[0, 0, 0, ip4(0, 0, 0, 1)]), None);
        assert!(is_loopback4(ip4(127, 0, 0, 6)) && !is_loopback4(a));
        assert!(is_unspecified(&[0; 4]) && !is_unspecified(&v4_mapped(a)));
        assert!(same(&v4_mapped(a), &v4_mapped(a)) && !same(&v4_mapped(a), &[a, 0, 0, 0]));
    }
}
