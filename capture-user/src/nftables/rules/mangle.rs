//! The mangle table: `--drop-invalid`, and TPROXY inbound capture.

use super::{
    enter_inbound, host_loopback, owners, passthrough_src, plain, Table, DIVERT, DROP_CHAIN,
    INBOUND, MANGLE_TABLE, OUTPUT, PREROUTING, TPROXY,
};
use crate::{
    config::{CaptureConfig, InterceptionMode, Selection},
    iptables::rules::{Family, TPROXY_MARK},
    nftables::stmt::{
        accept, counter, ct_mark, ct_state, daddr, dport, drop, iifname, jump, l4proto, mark,
        oifname, owner, restore_mark, ret, saddr, save_mark, set_mark, tproxy, L4,
    },
};

/// `excludeInterfaces` under TPROXY, `--drop-invalid`'s rule, and TPROXY inbound capture, in the
/// order of Istio's `tools/istio-nftables/pkg/capture/run.go`.
pub(super) fn mangle(cfg: &CaptureConfig, families: &[Family]) -> Table {
    let tproxy_mode = cfg.interception_mode == InterceptionMode::Tproxy;
    let capturing =
        tproxy_mode && !matches!(&cfg.include_inbound_ports, Selection::List(p) if p.is_empty());
    let mut chains = match (tproxy_mode, capturing) {
        (true, true) => vec![DIVERT, TPROXY, INBOUND],
        (true, false) => vec![INBOUND],
        (false, _) => Vec::new(),
    };
    if cfg.drop_invalid {
        chains.push(DROP_CHAIN);
    }
    let mut t = Table::new(MANGLE_TABLE, &chains);
    // TPROXY captures inbound in this table, so an excluded interface must leave it here too,
    // as it leaves the nat table.
    if tproxy_mode {
        for nic in &cfg.exclude_interfaces {
            t.append(PREROUTING, vec![iifname(nic), counter(), ret()]);
            t.append(OUTPUT, vec![oifname(nic, true), counter(), ret()]);
        }
    }
    if cfg.drop_invalid {
        // Istio's nftables mode drops invalid TCP only (its iptables mode every protocol).
        t.append(
            PREROUTING,
            vec![
                l4proto(L4::Tcp),
                ct_state(&["invalid"]),
                counter(),
                jump(DROP_CHAIN),
            ],
        );
        t.append(DROP_CHAIN, vec![counter(), drop()]);
    }
    if !tproxy_mode {
        return t;
    }
    let (tcp, m) = (L4::Tcp, TPROXY_MARK);
    if capturing {
        tproxy_inbound(cfg, families, &mut t);
    }
    t.append(
        PREROUTING,
        vec![l4proto(tcp), mark(m, true), counter(), save_mark()],
    );
    t.append(
        OUTPUT,
        vec![
            oifname("lo", true),
            l4proto(tcp),
            mark(m, true),
            counter(),
            ret(),
        ],
    );
    for (who, id) in owners(cfg) {
        t.append_each(OUTPUT, families, |f| {
            Some(vec![
                oifname("lo", true),
                l4proto(tcp),
                daddr(&host_loopback(cfg, f), false),
                owner(who, id, true),
                counter(),
                set_mark(m + 1),
            ])
        });
    }
    t.append(
        OUTPUT,
        vec![l4proto(tcp), ct_mark(m), counter(), restore_mark()],
    );
    // The first rules of istio-inbound, inserted as Istio inserts them (`insert rule ... index
    // N`): the proxy's own marked packets at 0, the passthrough source of each family at 1 (so
    // IPv6's lands before IPv4's), and loopback traffic that is not the proxy's at 2.
    t.insert(
        INBOUND,
        0,
        plain(vec![l4proto(tcp), mark(m, true), counter(), ret()]),
    );
    for f in families {
        let rule = plain(vec![
            iifname("lo"),
            l4proto(tcp),
            saddr(&passthrough_src(*f)),
            counter(),
            ret(),
        ]);
        t.insert(INBOUND, 1, rule);
    }
    t.insert(
        INBOUND,
        2,
        plain(vec![
            iifname("lo"),
            l4proto(tcp),
            mark(m + 1, false),
            counter(),
            ret(),
        ]),
    );
    t
}

/// The chains that divert inbound TCP to the proxy's transparent listener, and the jumps to
/// them, for every port or the listed ones.
fn tproxy_inbound(cfg: &CaptureConfig, families: &[Family], t: &mut Table) {
    let (tcp, m) = (L4::Tcp, TPROXY_MARK);
    t.append(DIVERT, vec![counter(), set_mark(m)]);
    t.append(DIVERT, vec![counter(), accept()]);
    t.append_each(TPROXY, families, |f| {
        Some(vec![
            l4proto(tcp),
            daddr(&host_loopback(cfg, f), false),
            tproxy(f, cfg.inbound_port),
            set_mark(m),
            counter(),
            accept(),
        ])
    });
    // iptables' TPROXY drops a packet no listener takes; nftables' tproxy lets it go on to the
    // next rule, which would deliver it to the app uncaptured.
    t.append_each(TPROXY, families, |f| {
        Some(vec![
            l4proto(tcp),
            daddr(&host_loopback(cfg, f), false),
            counter(),
            drop(),
        ])
    });
    let established = || ct_state(&["established", "related"]);
    match &cfg.include_inbound_ports {
        Selection::List(ports) if ports.is_empty() => {}
        // No tunnel-port exemption: under TPROXY the tunnel port is captured too.
        Selection::All => {
            enter_inbound(cfg, t, true);
            t.append(
                INBOUND,
                vec![l4proto(tcp), established(), counter(), jump(DIVERT)],
            );
            t.append(INBOUND, vec![l4proto(tcp), counter(), jump(TPROXY)]);
        }
        Selection::List(ports) => {
            enter_inbound(cfg, t, false);
            for p in ports {
                t.append(
                    INBOUND,
                    vec![
                        l4proto(tcp),
                        established(),
                        dport(tcp, *p, true),
                        counter(),
                        jump(DIVERT),
                    ],
                );
                t.append(INBOUND, vec![dport(tcp, *p, true), counter(), jump(TPROXY)]);
            }
        }
    }
}
