//! Which connections the app-to-proxy acceleration takes: connections that stay inside one pod
//! and have the proxy at one end. Both sockets of such a connection join `ACCEL_PEERS`; a write
//! on either then goes straight to the other's receive queue.

use crate::{
    config::{PodConfig, FLAG_ACCELERATE, MAX_PROXY_IDS},
    decision::routed_over_lo,
    AF_INET6,
};

/// How a socket came to be connected.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Side {
    /// It called `connect()`: `redirected` when capture sent it to the proxy, `by_proxy` when the
    /// proxy created it.
    Connecting { redirected: bool, by_proxy: bool },
    /// A listener accepted it. It joins whenever the connection is local: if its peer did not
    /// join, its writes find no peer and stay on TCP.
    Accepted,
}

/// The remote address is inside the pod: loopback, the passthrough source, or a pod address.
#[inline(always)]
#[must_use]
pub fn is_local(cfg: &PodConfig, family: u16, remote: &[u32; 4]) -> bool {
    routed_over_lo(cfg, family == AF_INET6, remote)
}

/// The creator's ids are the proxy's (uid or gid, as the owner rules match them).
#[inline(always)]
#[must_use]
pub fn is_proxy(cfg: &PodConfig, uid: u32, gid: u32) -> bool {
    let mut found = false;
    for i in 0..MAX_PROXY_IDS {
        let n = i as u32;
        if (n < cfg.proxy_uid_count && cfg.proxy_uids[i] == uid)
            || (n < cfg.proxy_gid_count && cfg.proxy_gids[i] == gid)
        {
            found = true;
        }
    }
    found
}

/// Does this established socket join the acceleration?
#[inline(always)]
#[must_use]
pub fn joins(cfg: &PodConfig, family: u16, remote: &[u32; 4], side: Side) -> bool {
    if !cfg.has(FLAG_ACCELERATE) || !is_local(cfg, family, remote) {
        return false;
    }
    match side {
        Side::Connecting {
            redirected,
            by_proxy,
        } => redirected || by_proxy,
        Side::Accepted => true,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{addr::ip4, config::FLAG_HAS_POD_IP4, decision::LOOPBACK6, AF_INET};

    fn pod() -> PodConfig {
        PodConfig {
            flags: FLAG_ACCELERATE | FLAG_HAS_POD_IP4,
            pod_ip4: ip4(10, 0, 0, 2),
            proxy_uid_count: 1,
            proxy_uids: [1337, 0, 0, 0],
            proxy_gid_count: 1,
            proxy_gids: [1337, 0, 0, 0],
            ..PodConfig::default()
        }
    }

    const APP: Side = Side::Connecting {
        redirected: false,
        by_proxy: false,
    };
    const REDIRECTED: Side = Side::Connecting {
        redirected: true,
        by_proxy: false,
    };
    const PROXY: Side = Side::Connecting {
        redirected: false,
        by_proxy: true,
    };

    #[test]
    fn only_local_connections_with_the_proxy_at_one_end_join() {
        let cfg = pod();
        let lo = [ip4(127, 0, 0, 1), 0, 0, 0];
        let own = [ip4(10, 0, 0, 2), 0, 0, 0];
        let remote = [ip4(10, 0, 0, 5), 0, 0, 0];
        assert!(joins(&cfg, AF_INET, &lo, REDIRECTED));
        assert!(joins(&cfg, AF_INET, &own, PROXY));
        assert!(joins(&cfg, AF_INET, &lo, Side::Accepted));
        assert!(!joins(&cfg, AF_INET, &lo, APP), "app to app stays on TCP");
        assert!(!joins(&cfg, AF_INET, &remote, PROXY), "leaves the pod");
        assert!(!joins(&cfg, AF_INET, &remote, Side::Accepted));
        assert!(joins(&cfg, AF_INET6, &LOOPBACK6, Side::Accepted));
        assert!(
            !joins(&cfg, AF_INET6, &[0, 0, 0, ip4(0, 0, 0, 9)], Side::Accepted),
            "an IPv6 pod address the pod does not have"
        );
    }

    #[test]
    fn a_pod_without_the_flag_never_joins() {
        let cfg = PodConfig {
            flags: FLAG_HAS_POD_IP4,
            ..pod()
        };
        assert!(!joins(
            &cfg,
            AF_INET,
            &[ip4(127, 0, 0, 1), 0, 0, 0],
            REDIRECTED
        ));
    }

    #[test]
    fn the_proxy_is_known_by_uid_or_gid() {
        let cfg = pod();
        assert!(is_proxy(&cfg, 1337, 0));
        assert!(is_proxy(&cfg, 0, 1337));
        assert!(!is_proxy(&cfg, 1000, 1000));
        let none = PodConfig {
            proxy_uid_count: 0,
            proxy_gid_count: 0,
            ..cfg
        };
        assert!(
            !is_proxy(&none, 1337, 1337),
            "counts select the live entries"
        );
    }
}
