//! The mangle table: `--drop-invalid`, and TPROXY inbound capture.

use super::{
    enter_inbound, host_loopback, owners, passthrough_src, plain, Table, DIVERT, INBOUND,
    MANGLE_TABLE, OUTPUT, PREROUTING, TPROXY,
};
use crate::{
    config::{CaptureConfig, InterceptionMode, Selection},
    iptables::rules::{Family, TPROXY_MARK},
    nftables::stmt::{
        accept, counter, ct_mark, ct_state, daddr, dport, drop, iifname, jump, l4proto, mark,
        oifname, owner, restore_mark, ret, saddr, save_mark, set_mark, tproxy, L4,
    },
};

/// `--drop-invalid`'s rule, and TPROXY inbound capture.
pub(super) fn mangle(cfg: &CaptureConfig, families: &[Family]) -> Table {
    let tproxy_mode = cfg.interception_mode == InterceptionMode::Tproxy;
    let chains: &[&'static str] = if tproxy_mode {
        &[DIVERT, TPROXY, INBOUND]
    } else {
        &[]
    };
    let mut t = Table::new(MANGLE_TABLE, chains);
    if cfg.drop_invalid {
        t.append(PREROUTING, vec![ct_state(&["invalid"]), counter(), drop()]);
    }
    if !tproxy_mode {
        return t;
    }
    let (tcp, m) = (L4::Tcp, TPROXY_MARK);
    t.append(DIVERT, vec![counter(), set_mark(m)]);
    t.append(DIVERT, vec![counter(), accept()]);
    t.append_each(TPROXY, families, |f| {
        Some(vec![
            l4proto(tcp),
            daddr(&host_loopback(cfg, f), false),
            counter(),
            tproxy(f, cfg.inbound_port),
            set_mark(m),
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
            enter_inbound(cfg, &mut t, true);
            t.append(
                INBOUND,
                vec![l4proto(tcp), established(), counter(), jump(DIVERT)],
            );
            t.append(INBOUND, vec![l4proto(tcp), counter(), jump(TPROXY)]);
        }
        Selection::List(ports) => {
            enter_inbound(cfg, &mut t, false);
            for p in ports {
                let port = || dport(tcp, *p, true);
                t.append(
                    INBOUND,
                    vec![port(), established(), counter(), jump(DIVERT)],
                );
                t.append(INBOUND, vec![port(), counter(), jump(TPROXY)]);
            }
        }
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
    // The first rules of istio-inbound, in this order: the proxy's own marked packets, its
    // passthrough source, and loopback traffic that is not the proxy's.
    let mut first = vec![plain(vec![l4proto(tcp), mark(m, true), counter(), ret()])];
    first.extend(families.iter().map(|f| {
        plain(vec![
            iifname("lo"),
            l4proto(tcp),
            saddr(&passthrough_src(*f)),
            counter(),
            ret(),
        ])
    }));
    first.push(plain(vec![
        iifname("lo"),
        l4proto(tcp),
        mark(m + 1, false),
        counter(),
        ret(),
    ]));
    for (i, rule) in first.into_iter().enumerate() {
        t.insert(INBOUND, i, rule);
    }
    t
}
