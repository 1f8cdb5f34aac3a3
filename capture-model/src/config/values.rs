//! Annotation values as Istio's injector reads them: comma lists, ports, CIDRs, interface names,
//! the loopback range; every bad value becomes an error that names the annotation.

use std::net::{IpAddr, Ipv4Addr};

use ipnet::{IpNet, Ipv4Net};

use super::{ConfigError, Selection};

pub(super) fn bad(key: &str, value: &str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Annotation {
        key: key.into(),
        value: value.into(),
        reason: reason.into(),
    }
}

/// Comma-separated items, empty ones dropped (Istio's list parsing).
pub fn items(value: &str) -> impl Iterator<Item = &str> {
    value.split(',').map(str::trim).filter(|s| !s.is_empty())
}

/// The items of an annotation list as Istio's injector validates them: an empty value is an empty
/// list, but an empty item inside a list ("80,,443", a trailing comma) is an error.
pub(super) fn annotation_items<'a>(key: &str, value: &'a str) -> Result<Vec<&'a str>, ConfigError> {
    if value.trim().is_empty() {
        return Ok(Vec::new());
    }
    value
        .split(',')
        .map(|item| {
            if item.trim().is_empty() {
                Err(bad(key, value, "has an empty item; remove the extra comma"))
            } else {
                Ok(item)
            }
        })
        .collect()
}

pub(super) fn parse_port(key: &str, value: &str, item: &str) -> Result<u16, ConfigError> {
    match item.parse::<u16>() {
        Ok(p) if p != 0 => Ok(p),
        _ => Err(bad(
            key,
            value,
            format!("{item:?} is not a port; use numbers 1-65535, comma-separated"),
        )),
    }
}

pub(super) fn parse_ports(key: &str, value: &str) -> Result<Vec<u16>, ConfigError> {
    let mut ports = Vec::new();
    for item in annotation_items(key, value)? {
        let p = parse_port(key, value, item.trim())?;
        if !ports.contains(&p) {
            ports.push(p);
        }
    }
    Ok(ports)
}

pub(super) fn parse_port_selection(key: &str, value: &str) -> Result<Selection<u16>, ConfigError> {
    if value.trim() == "*" {
        return Ok(Selection::All);
    }
    parse_ports(key, value).map(Selection::List)
}

pub(super) fn parse_cidrs(key: &str, value: &str) -> Result<Vec<IpNet>, ConfigError> {
    annotation_items(key, value)?
        .into_iter()
        .map(|item| {
            item.parse::<IpNet>().map(|n| n.trunc()).map_err(|_| {
                let hint = if item.trim() != item {
                    format!("{item:?} has spaces around it; Istio's validation rejects them, write the CIDRs without spaces")
                } else if item.parse::<IpAddr>().is_ok() {
                    format!("{item:?} has no prefix length; write {item}/32 (or /128 for IPv6)")
                } else if item == "*" {
                    "\"*\" is allowed only as the whole value of an include list".to_string()
                } else {
                    format!("{item:?} is not a CIDR such as 10.0.0.0/8 or fd00::/8")
                };
                bad(key, value, hint)
            })
        })
        .collect()
}

pub(super) fn parse_cidr_selection(
    key: &str,
    value: &str,
) -> Result<Selection<IpNet>, ConfigError> {
    if value.trim() == "*" {
        return Ok(Selection::All);
    }
    parse_cidrs(key, value).map(Selection::List)
}

/// Interface names (what `ip link` accepts: 1-15 characters, no '/', no whitespace).
pub(super) fn parse_interfaces(key: &str, value: &str) -> Result<Vec<String>, ConfigError> {
    annotation_items(key, value)?
        .into_iter()
        .map(str::trim)
        .map(|name| {
            if name.len() > 15
                || name.contains('/')
                || name.contains(char::is_whitespace)
                || name == "."
                || name == ".."
            {
                Err(bad(
                    key,
                    value,
                    format!("{name:?} is not an interface name"),
                ))
            } else {
                Ok(name.to_string())
            }
        })
        .collect()
}

/// `ISTIO_OUTBOUND_IPV4_LOOPBACK_CIDR`: a prefix of 127.0.0.0/8, length 8 to 32.
pub(super) fn host_loopback_cidr(value: Option<&str>) -> Result<Ipv4Net, ConfigError> {
    let Some(v) = value else {
        return Ok(Ipv4Net::new(Ipv4Addr::LOCALHOST, 32).expect("valid prefix"));
    };
    let err = |reason: &str| ConfigError::Pod(format!("IPv4 loopback CIDR {v:?}: {reason}"));
    let net: Ipv4Net = v
        .trim()
        .parse()
        .map_err(|_| err("not a CIDR such as 127.0.0.1/32"))?;
    if !net.network().is_loopback() || net.prefix_len() < 8 {
        return Err(err(
            "must be inside 127.0.0.0/8 with a prefix length of 8 to 32",
        ));
    }
    Ok(net)
}

/// A comma-separated list of uids or gids (`capture.dev/proxy-uid`).
pub(super) fn parse_ids(key: &str, value: &str) -> Result<Vec<u32>, ConfigError> {
    let ids = value
        .split(',')
        .map(|item| {
            item.trim()
                .parse::<u32>()
                .map_err(|_| bad(key, value, format!("{:?} is not a uid or gid", item.trim())))
        })
        .collect::<Result<Vec<_>, _>>()?;
    if ids.is_empty() || ids.len() > super::MAX_PROXY_IDS {
        return Err(bad(
            key,
            value,
            format!("name 1 to {} ids", super::MAX_PROXY_IDS),
        ));
    }
    Ok(ids)
}
