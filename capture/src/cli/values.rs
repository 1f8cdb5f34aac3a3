//! Parsers for the command line's own value syntax (`KEY=VALUE`, id lists, listen addresses).

use std::net::{IpAddr, SocketAddr};

use crate::config::{values::items, ANN_EXCLUDE_OUTBOUND_PORTS};

/// Parses `KEY=VALUE` (the CLI's `--annotation`).
pub fn parse_annotation(arg: &str) -> Result<(String, String), String> {
    let (k, v) = arg.split_once('=').ok_or_else(|| {
        format!("{arg:?} is not KEY=VALUE (for example {ANN_EXCLUDE_OUTBOUND_PORTS}=5432)")
    })?;
    if k.trim().is_empty() {
        return Err(format!("{arg:?} has an empty annotation key"));
    }
    Ok((k.trim().to_string(), v.to_string()))
}

/// A comma-separated id list (`--proxy-uid 1337,1338`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct IdList(pub Vec<u32>);

/// `NAMESPACE/NAME`.
pub fn parse_pod_name(arg: &str) -> Result<(String, String), String> {
    match arg.split_once('/') {
        Some((namespace, name))
            if !namespace.is_empty() && !name.is_empty() && !name.contains('/') =>
        {
            Ok((namespace.to_string(), name.to_string()))
        }
        _ => Err(format!(
            "{arg:?} is not NAMESPACE/NAME (for example default/httpbin-7d9c)"
        )),
    }
}

pub fn parse_id_list(arg: &str) -> Result<IdList, String> {
    items(arg)
        .map(|s| {
            s.parse::<u32>()
                .map_err(|_| format!("{s:?} is not a numeric uid/gid"))
        })
        .collect::<Result<_, _>>()
        .map(IdList)
}

/// An `ADDRESS:PORT` to listen on. Besides Rust's own forms (`10.0.0.5:15301`,
/// `[fd00::5]:15301`) it takes an IPv6 address without brackets (`fd00::5:15301`, the last
/// field being the port): a manifest builds the argument as `$(NODE_IP):15301` from the node's
/// address, which Kubernetes substitutes without brackets.
pub fn parse_listen_addr(arg: &str) -> Result<SocketAddr, String> {
    if let Ok(addr) = arg.parse() {
        return Ok(addr);
    }
    let bad =
        || format!("{arg:?} is not ADDRESS:PORT (for example 10.0.0.5:15301 or [fd00::5]:15301)");
    let (host, port) = arg.rsplit_once(':').ok_or_else(bad)?;
    let ip: IpAddr = host.parse().map_err(|_| bad())?;
    let port: u16 = port.parse().map_err(|_| bad())?;
    Ok(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn annotation_and_id_arguments() {
        assert_eq!(
            parse_annotation("a/b=c=d").unwrap(),
            ("a/b".into(), "c=d".into())
        );
        assert!(parse_annotation("novalue").is_err());
        assert_eq!(
            parse_id_list("1337, 1338").unwrap(),
            IdList(vec![1337, 1338])
        );
        assert!(parse_id_list("istio").is_err());
    }

    #[test]
    fn listen_addresses_with_and_without_brackets() {
        for (arg, want) in [
            ("127.0.0.1:15300", "127.0.0.1:15300"),
            ("[fd00::5]:15301", "[fd00::5]:15301"),
            ("fd00::5:15301", "[fd00::5]:15301"),
            ("::1:80", "[::1]:80"),
            ("0.0.0.0:9", "0.0.0.0:9"),
        ] {
            assert_eq!(parse_listen_addr(arg).unwrap().to_string(), want, "{arg}");
        }
        for arg in [
            "",
            "10.0.0.5",
            "10.0.0.5:",
            ":15301",
            "10.0.0.5:70000",
            "$(NODE_IP):15301",
            "fd00::5",
        ] {
            let e = parse_listen_addr(arg).unwrap_err();
            assert!(e.contains("ADDRESS:PORT"), "{arg}: {e}");
        }
    }
}
