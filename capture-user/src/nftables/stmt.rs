//! The statements capture's rules are made of, as the `nftables` crate's JSON schema types: one
//! small constructor per nft phrase (`tcp dport 80`, `skuid 1337`, `redirect to :15001`), so that
//! `rules.rs` reads like Istio's nftables rules.

use std::borrow::Cow;

use ipnet::IpNet;
use nftables::{
    expr::{
        BinaryOperation, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Prefix,
        SetItem, CT,
    },
    stmt::{Counter, JumpTarget, Mangle, Match, Operator, Statement, TProxy, NAT},
};

use crate::iptables::rules::Family;

pub type Stmt = Statement<'static>;
type Expr = Expression<'static>;

fn meta(key: MetaKey) -> Expr {
    Expression::Named(NamedExpression::Meta(Meta { key }))
}

fn ct(key: &'static str) -> Expr {
    Expression::Named(NamedExpression::CT(CT {
        key: Cow::Borrowed(key),
        family: None,
        dir: None,
    }))
}

fn payload(protocol: &'static str, field: &'static str) -> Expr {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: Cow::Borrowed(protocol),
            field: Cow::Borrowed(field),
        },
    )))
}

fn text(s: &str) -> Expr {
    Expression::String(Cow::Owned(s.to_owned()))
}

fn matches(left: Expr, op: Operator, right: Expr) -> Stmt {
    Statement::Match(Match { left, right, op })
}

fn op(equal: bool) -> Operator {
    if equal {
        Operator::EQ
    } else {
        Operator::NEQ
    }
}

/// The layer-4 protocols capture's rules name.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum L4 {
    Tcp,
    Udp,
}

impl L4 {
    fn name(self) -> &'static str {
        match self {
            Self::Tcp => "tcp",
            Self::Udp => "udp",
        }
    }
}

/// `meta l4proto tcp`: what iptables' `-p tcp` says where no port follows.
pub fn l4proto(proto: L4) -> Stmt {
    matches(meta(MetaKey::L4proto), Operator::EQ, text(proto.name()))
}

/// `meta nfproto ipv6`: the family a packet belongs to, in an `inet` table.
pub fn nfproto(family: Family) -> Stmt {
    let name = match family {
        Family::V4 => "ipv4",
        Family::V6 => "ipv6",
    };
    matches(meta(MetaKey::Nfproto), Operator::EQ, text(name))
}

/// `tcp dport 80` (or `!= 80`).
pub fn dport(proto: L4, port: u16, equal: bool) -> Stmt {
    matches(
        payload(proto.name(), "dport"),
        op(equal),
        Expression::Number(port.into()),
    )
}

/// `tcp dport != { 53, 15008 }`: iptables' `-m multiport ! --dports`.
pub fn dport_not_in(proto: L4, ports: &[u16]) -> Stmt {
    let set = ports
        .iter()
        .map(|p| SetItem::Element(Expression::Number((*p).into())))
        .collect();
    matches(
        payload(proto.name(), "dport"),
        Operator::NEQ,
        Expression::Named(NamedExpression::Set(set)),
    )
}

/// `udp sport 53`.
pub fn sport(proto: L4, port: u16) -> Stmt {
    matches(
        payload(proto.name(), "sport"),
        Operator::EQ,
        Expression::Number(port.into()),
    )
}

fn address(field: &'static str, net: &IpNet, equal: bool) -> Stmt {
    let protocol = match net {
        IpNet::V4(_) => "ip",
        IpNet::V6(_) => "ip6",
    };
    let prefix = Expression::Named(NamedExpression::Prefix(Prefix {
        addr: Box::new(text(&net.addr().to_string())),
        len: net.prefix_len().into(),
    }));
    matches(payload(protocol, field), op(equal), prefix)
}

/// `ip daddr 10.0.0.0/8` (or `ip6 daddr`, after the prefix's family).
pub fn daddr(net: &IpNet, equal: bool) -> Stmt {
    address("daddr", net, equal)
}

/// `ip saddr 127.0.0.6/32`.
pub fn saddr(net: &IpNet) -> Stmt {
    address("saddr", net, true)
}

/// `oifname "lo"` (or `!=`).
pub fn oifname(name: &str, equal: bool) -> Stmt {
    matches(meta(MetaKey::Oifname), op(equal), text(name))
}

/// `iifname "lo"`.
pub fn iifname(name: &str) -> Stmt {
    matches(meta(MetaKey::Iifname), Operator::EQ, text(name))
}

/// Which of a socket's owners a rule matches: iptables' `--uid-owner` or `--gid-owner`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Owner {
    Uid,
    Gid,
}

/// `meta skuid 1337` (or `skgid`, or `!=`).
pub fn owner(owner: Owner, id: u32, equal: bool) -> Stmt {
    let key = match owner {
        Owner::Uid => MetaKey::Skuid,
        Owner::Gid => MetaKey::Skgid,
    };
    matches(meta(key), op(equal), Expression::Number(id))
}

/// `meta mark 1337` (or `!=`).
pub fn mark(value: u32, equal: bool) -> Stmt {
    matches(meta(MetaKey::Mark), op(equal), Expression::Number(value))
}

/// `ct mark 1337`.
pub fn ct_mark(value: u32) -> Stmt {
    matches(ct("mark"), Operator::EQ, Expression::Number(value))
}

/// `ct state invalid`, `ct state { related, established }`.
pub fn ct_state(states: &[&'static str]) -> Stmt {
    let right = Expression::List(states.iter().map(|s| text(s)).collect());
    matches(ct("state"), Operator::IN, right)
}

/// `tcp flags & (fin | syn | rst | ack) != syn`: iptables' `! --syn`, a packet that cannot open
/// a connection.
pub fn not_syn() -> Stmt {
    let flags = ["fin", "syn", "rst", "ack"].map(text).to_vec();
    let masked = Expression::BinaryOperation(Box::new(BinaryOperation::AND(
        payload("tcp", "flags"),
        Expression::BinaryOperation(Box::new(BinaryOperation::OR(flags))),
    )));
    matches(masked, Operator::NEQ, text("syn"))
}

/// An anonymous `counter`: every rule counts what it matched, as Istio's do, for an operator
/// reading `nft list ruleset`.
pub fn counter() -> Stmt {
    Statement::Counter(Counter::Anonymous(None))
}

pub fn ret() -> Stmt {
    Statement::Return(None)
}

pub fn accept() -> Stmt {
    Statement::Accept(None)
}

pub fn drop() -> Stmt {
    Statement::Drop(None)
}

pub fn jump(chain: &'static str) -> Stmt {
    Statement::Jump(JumpTarget {
        target: Cow::Borrowed(chain),
    })
}

/// `redirect to :15001`.
pub fn redirect(port: u16) -> Stmt {
    Statement::Redirect(Some(NAT {
        addr: None,
        family: None,
        port: Some(Expression::Number(port.into())),
        flags: None,
    }))
}

/// `tproxy ip to :15006`.
pub fn tproxy(family: Family, port: u16) -> Stmt {
    let name = match family {
        Family::V4 => "ip",
        Family::V6 => "ip6",
    };
    Statement::TProxy(TProxy {
        family: Some(Cow::Borrowed(name)),
        port,
        addr: None,
    })
}

fn set(key: Expr, value: Expr) -> Stmt {
    Statement::Mangle(Mangle { key, value })
}

/// `meta mark set 1337`.
pub fn set_mark(value: u32) -> Stmt {
    set(meta(MetaKey::Mark), Expression::Number(value))
}

/// `ct zone set 1`.
pub fn set_ct_zone(zone: u32) -> Stmt {
    set(ct("zone"), Expression::Number(zone))
}

/// `ct mark set mark`: iptables' `CONNMARK --save-mark`.
pub fn save_mark() -> Stmt {
    set(ct("mark"), meta(MetaKey::Mark))
}

/// `meta mark set ct mark`: iptables' `CONNMARK --restore-mark`.
pub fn restore_mark() -> Stmt {
    set(meta(MetaKey::Mark), ct("mark"))
}
