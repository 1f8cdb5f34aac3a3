//! The raw table: DNS capture's conntrack zones.

use ipnet::IpNet;

use super::{nameservers, owners, Table, INBOUND, OUTPUT, OUTPUT_DNS, PREROUTING, RAW_TABLE};
use crate::{
    config::CaptureConfig,
    iptables::rules::Family,
    nftables::stmt::{counter, daddr, dport, jump, owner, saddr, set_ct_zone, sport, L4},
};

/// DNS capture's conntrack zones, which keep the proxy's own DNS apart from the app's so that
/// replies are un-NATed.
pub(super) fn raw(cfg: &CaptureConfig, families: &[Family]) -> Table {
    let mut t = Table::new(RAW_TABLE, &[OUTPUT_DNS, INBOUND]);
    let Some(dns) = &cfg.dns else {
        return t;
    };
    let udp = L4::Udp;
    t.append(OUTPUT, vec![counter(), jump(OUTPUT_DNS)]);
    for (who, id) in owners(cfg) {
        t.append(
            OUTPUT_DNS,
            vec![
                dport(udp, 53, true),
                owner(who, id, true),
                counter(),
                set_ct_zone(1),
            ],
        );
        t.append(
            OUTPUT_DNS,
            vec![
                sport(udp, dns.port),
                owner(who, id, true),
                counter(),
                set_ct_zone(2),
            ],
        );
    }
    t.append(PREROUTING, vec![counter(), jump(INBOUND)]);
    let servers: Vec<Option<IpNet>> = if dns.capture_all {
        vec![None]
    } else {
        nameservers(cfg, families).into_iter().map(Some).collect()
    };
    for server in servers {
        let mut out = vec![dport(udp, 53, true)];
        out.extend(server.map(|n| daddr(&n, true)));
        out.extend([counter(), set_ct_zone(2)]);
        t.append(OUTPUT_DNS, out);
        let mut back = vec![sport(udp, 53)];
        back.extend(server.map(|n| saddr(&n)));
        back.extend([counter(), set_ct_zone(1)]);
        t.append(INBOUND, back);
    }
    t
}
