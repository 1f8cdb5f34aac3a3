//! The stateless redirect of TCP connections: a pod gives each original destination a loopback
//! address of its own, in `127.2.0.0/19`, kept in `LOOPBACK_DESTS` from the first connection to
//! it until the pod goes. IPv6 has one loopback address, so an IPv6 destination's address is its
//! slot's twin in `100::/64` (`address6`), which attach routes to `lo` in the pod's netns: RFC
//! 6666's discard-only prefix, which no real destination is in. Both families share the pod's
//! slots; the table's value says which family the destination is. A connection redirected there carries its original
//! destination in its own address, so `SO_ORIGINAL_DST` and getpeername read it from the address,
//! and neither the app's socket nor the proxy's needs any state.
//!
//! A destination's address is found by probing: a few candidates picked by hashing it, the first
//! one free or already its own taken. The range is apart from the stateful path's
//! (`decision::spread_loopback4`, `127.1.0.0/16`), so an address in it always means this table.

use crate::addr::ip4;

/// The first address of the range (host order).
const RANGE_START: u32 = u32::from_be(ip4(127, 2, 0, 0));
/// The range's size: every address that stands for an original destination, including those
/// builds before `POD_LOOPBACK_QUOTA` gave from all of it (a takeover keeps them).
pub const LOOPBACK_SLOTS: u32 = 8192;
/// The addresses a pod is given, the first of the range: the most destinations one pod can have
/// addresses for, its share of `LOOPBACK_DESTS`, which is sized for every pod at this share.
/// Beyond, or when no probe finds a free address, connections take the stateful path.
pub const POD_LOOPBACK_QUOTA: u32 = 512;
/// Candidates tried per destination.
pub const LOOPBACK_PROBES: u32 = 8;

/// Candidate `probe` for `dst:port` (`dst` in network order, `port` in host order); network
/// order, always among a pod's `POD_LOOPBACK_QUOTA` addresses.
#[must_use]
pub const fn candidate(dst: u32, port: u16, probe: u32) -> u32 {
    let mut h = dst ^ (port as u32).wrapping_mul(0x9E37_79B1);
    h = h.wrapping_mul(0x85EB_CA6B);
    h ^= h >> 15;
    h = h.wrapping_mul(0xC2B2_AE35);
    h ^= h >> 16;
    // Probes step by an odd stride, which visits every slot of the power-of-two share.
    let slot = (h.wrapping_add(probe.wrapping_mul((h >> 13) | 1))) % POD_LOOPBACK_QUOTA;
    (RANGE_START + slot).to_be()
}

/// Is `addr` (network order) in the range?
#[must_use]
pub const fn in_range(addr: u32) -> bool {
    u32::from_be(addr).wrapping_sub(RANGE_START) < LOOPBACK_SLOTS
}

/// Word 0 of `100::/64` (network order); words 1 and 2 are zero.
pub const RANGE6_WORD0: u32 = 0x0100_0000u32.to_be();

/// The IPv6 twin of slot address `addr4` (network order): `100::7f02:xxyy`.
#[must_use]
pub const fn address6(addr4: u32) -> [u32; 4] {
    [RANGE6_WORD0, 0, 0, addr4]
}

/// The slot address of `addr` (network order words) if it is the twin of one.
#[must_use]
pub const fn slot_of6(addr: &[u32; 4]) -> Option<u32> {
    if addr[0] == RANGE6_WORD0 && addr[1] == 0 && addr[2] == 0 && in_range(addr[3]) {
        Some(addr[3])
    } else {
        None
    }
}

/// The 32 bits a destination's candidates are hashed from: the IPv4 address itself (word 0, the
/// others zero), every word of an IPv6 one folded.
#[must_use]
pub const fn hash_input(dst: &[u32; 4]) -> u32 {
    dst[0] ^ dst[1] ^ dst[2] ^ dst[3]
}

/// Every address of the range, in network order (user space removes a pod's entries by them).
pub fn all() -> impl Iterator<Item = u32> {
    (0..LOOPBACK_SLOTS).map(|slot| (RANGE_START + slot).to_be())
}

const _: () = assert!(POD_LOOPBACK_QUOTA.is_power_of_two() && POD_LOOPBACK_QUOTA <= LOOPBACK_SLOTS);

#[cfg(test)]
mod tests {
    extern crate std;
    use std::collections::BTreeSet;

    use super::*;

    #[test]
    fn candidates_stay_in_the_range_and_differ_per_probe() {
        for dst in [ip4(10, 0, 0, 5), ip4(192, 168, 1, 1), 0, u32::MAX] {
            for port in [80u16, 443, 0, u16::MAX] {
                let probes: BTreeSet<u32> = (0..LOOPBACK_PROBES)
                    .map(|p| candidate(dst, port, p))
                    .collect();
                assert!(probes.iter().all(|&a| in_range(a)), "{dst:#x}:{port}");
                let first_slots = u32::from_be(ip4(127, 2, 0, 0))..;
                assert!(
                    probes
                        .iter()
                        .all(|&a| (u32::from_be(a) - first_slots.start) < POD_LOOPBACK_QUOTA),
                    "{dst:#x}:{port} is given one of the pod's own share"
                );
                assert_eq!(probes.len(), LOOPBACK_PROBES as usize, "{dst:#x}:{port}");
            }
        }
    }

    #[test]
    fn the_range_is_127_2_0_0_slash_19_and_apart_from_the_stateful_spread() {
        assert!(in_range(ip4(127, 2, 0, 0)));
        assert!(in_range(ip4(127, 2, 31, 255)));
        assert!(!in_range(ip4(127, 2, 32, 0)));
        assert!(!in_range(ip4(127, 1, 255, 255)));
        assert!(!in_range(ip4(127, 0, 0, 1)));
        assert_eq!(all().count(), LOOPBACK_SLOTS as usize);
        // The IPv6 twin: 100::7f02:0 to 100::7f02:1fff, outside v4-mapped and loopback space.
        let twin = address6(ip4(127, 2, 1, 7));
        assert_eq!(slot_of6(&twin), Some(ip4(127, 2, 1, 7)));
        assert_eq!(twin[0].to_ne_bytes(), [1, 0, 0, 0], "100::");
        assert_eq!(slot_of6(&address6(ip4(127, 2, 32, 0))), None);
        assert_eq!(slot_of6(&[0, 0, 0, ip4(127, 2, 1, 7)]), None);
        assert_eq!(slot_of6(&crate::addr::v4_mapped(ip4(127, 2, 1, 7))), None);
        // An IPv4 destination hashes as it always did (tables survive a takeover).
        assert_eq!(hash_input(&[ip4(10, 0, 0, 5), 0, 0, 0]), ip4(10, 0, 0, 5));
        for port in 0..2000u16 {
            let spread = crate::decision::spread_loopback4(ip4(10, 0, 0, 5), port);
            assert!(!in_range(spread));
        }
    }

    #[test]
    fn destinations_spread_over_the_share() {
        // 256 destinations (half the quota): first candidates land on many distinct slots, so
        // few need a second probe.
        let firsts: BTreeSet<u32> = (0..256u32)
            .map(|i| candidate(ip4(10, 0, (i >> 8) as u8, i as u8), 80, 0))
            .collect();
        assert!(firsts.len() > 180, "{} distinct", firsts.len());
        // And 400 destinations (78%) nearly all find an address within their probes.
        let mut taken = BTreeSet::new();
        let placed = (0..400u32)
            .filter(|i| {
                let dst = ip4(10, 1, (i >> 8) as u8, *i as u8);
                (0..LOOPBACK_PROBES).any(|p| taken.insert(candidate(dst, 443, p)))
            })
            .count();
        assert!(placed >= 390, "{placed} of 400 placed");
    }
}
