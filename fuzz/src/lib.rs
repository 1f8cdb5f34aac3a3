//! What the fuzz targets share: the text form of a pod (annotations and the node's mesh settings)
//! that the `annotations` corpus is written in, and the invariants every parsed configuration
//! must hold.

use std::net::{IpAddr, Ipv4Addr};

use capture_model::config::{
    CaptureConfig, ConfigError, Defaults, OwnerGroups, PodSpec, Selection, MAX_OWNER_GROUPS,
    MAX_PROXY_IDS,
};

/// The pod address a spec gets when its text names none: without one, validation stops before
/// it reads most annotations, and the fuzzer would spend its time there.
pub const DEFAULT_POD_IP: IpAddr = IpAddr::V4(Ipv4Addr::new(10, 1, 0, 5));

/// A pod from its text form: entries separated by NUL bytes (annotation values, the proxy-config
/// YAML among them, may hold newlines), each `key=value`. Keys starting with `@` set what is not
/// an annotation: `@ip`, `@uid`, `@gid` (repeatable), `@defaults` (`cni` or `init`),
/// `@owner_groups`, `@owner_groups_exclude`, `@loopback_cidr`, `@nameserver` (repeatable),
/// `@redirect_dns`, `@capture_all_dns`, `@drop_invalid` (any value turns them on). Any other
/// key is an annotation. Entries without `=` and values that do not parse (an `@ip` that is
/// no address) are ignored, so every input is some pod.
#[must_use]
pub fn pod_spec(text: &str) -> PodSpec {
    let mut spec = PodSpec::default();
    for entry in text.split('\0') {
        let Some((key, value)) = entry.split_once('=') else {
            continue;
        };
        match key {
            "@ip" => spec.pod_ips.extend(value.parse::<IpAddr>().ok()),
            "@uid" => spec.proxy_uids.extend(value.parse::<u32>().ok()),
            "@gid" => spec.proxy_gids.extend(value.parse::<u32>().ok()),
            "@defaults" => {
                spec.defaults = if value == "cni" {
                    Defaults::IstioCni
                } else {
                    Defaults::IstioInit
                }
            }
            "@owner_groups" => spec.mesh.owner_groups = Some(value.into()),
            "@owner_groups_exclude" => spec.mesh.owner_groups_exclude = Some(value.into()),
            "@loopback_cidr" => spec.mesh.ipv4_loopback_cidr = Some(value.into()),
            "@nameserver" => spec.mesh.nameservers.extend(value.parse::<IpAddr>().ok()),
            "@redirect_dns" => spec.mesh.redirect_dns = true,
            "@capture_all_dns" => spec.mesh.capture_all_dns = true,
            "@drop_invalid" => spec.mesh.drop_invalid = true,
            _ => {
                spec.annotations.insert(key.into(), value.into());
            }
        }
    }
    if spec.pod_ips.is_empty() {
        spec.pod_ips.push(DEFAULT_POD_IP);
    }
    spec
}

fn distinct<T: PartialEq + std::fmt::Debug>(what: &str, list: &[T]) {
    for (i, item) in list.iter().enumerate() {
        assert!(
            !list[..i].contains(item),
            "{what} lists {item:?} twice: {list:?}"
        );
    }
}

/// What every configuration that validation lets through must hold: the kernel side and the
/// iptables rules take these for granted.
pub fn check_config(spec: &PodSpec, cfg: &CaptureConfig) {
    // Asked for, spelled exactly: anything else than true or false is an error, never a yes.
    let asked = spec
        .annotations
        .get(capture_model::config::ANN_ACCELERATE)
        .is_some_and(|v| v.trim() == "true");
    assert_eq!(
        cfg.accelerate, asked,
        "acceleration from {:?}",
        spec.annotations
    );
    let ports = [
        ("include_outbound_ports", &cfg.include_outbound_ports),
        ("exclude_outbound_ports", &cfg.exclude_outbound_ports),
        ("exclude_inbound_ports", &cfg.exclude_inbound_ports),
    ];
    for (what, list) in ports {
        assert!(!list.contains(&0), "{what} holds port 0: {list:?}");
        distinct(what, list);
    }
    if let Selection::List(list) = &cfg.include_inbound_ports {
        assert!(!list.contains(&0), "include_inbound_ports holds port 0");
        distinct("include_inbound_ports", list);
    }
    // istio-iptables' own defaults exclude only what the pod names; the injector and istio-cni
    // always exclude the health and telemetry ports.
    let always_excluded: &[u16] = match spec.defaults {
        Defaults::IstioIptables => &[],
        Defaults::IstioInit | Defaults::IstioCni => &[15021, 15090],
    };
    for &port in always_excluded {
        assert!(
            cfg.exclude_inbound_ports.contains(&port),
            "inbound port {port} is always excluded, yet missing from {:?}",
            cfg.exclude_inbound_ports
        );
    }
    let cidrs = match &cfg.include_outbound_cidrs {
        Selection::All => Vec::new(),
        Selection::List(list) => list.clone(),
    };
    for net in cidrs.iter().chain(&cfg.exclude_outbound_cidrs) {
        assert_eq!(*net, net.trunc(), "CIDR {net} keeps host bits");
    }
    for name in cfg
        .exclude_interfaces
        .iter()
        .chain(&cfg.reroute_virtual_interfaces)
    {
        assert!(
            !name.is_empty()
                && name.len() <= 15
                && !name.contains('/')
                && !name.contains(char::is_whitespace),
            "{name:?} passed as an interface name"
        );
    }
    assert!(cfg.proxy_uids.len() <= MAX_PROXY_IDS && cfg.proxy_gids.len() <= MAX_PROXY_IDS);
    assert!(!cfg.proxy_uids.is_empty() && !cfg.proxy_gids.is_empty());
    if let OwnerGroups::Only(g) | OwnerGroups::AllBut(g) = &cfg.owner_groups {
        assert!(g.len() <= MAX_OWNER_GROUPS, "{} owner groups", g.len());
    }
    assert!(cfg.host_loopback_cidr.network().is_loopback());
    assert!(cfg.pod_ip4.is_some() || cfg.pod_ip6.is_some());
    for ip in cfg
        .pod_ip4
        .map(IpAddr::V4)
        .iter()
        .chain(&cfg.pod_ip6.map(IpAddr::V6))
    {
        assert!(spec.pod_ips.contains(ip), "pod IP {ip} was not given");
    }
    // Records keep the configuration as JSON: what is accepted must come back the same.
    let json = serde_json::to_vec(cfg).expect("configurations serialise");
    let back: CaptureConfig = serde_json::from_slice(&json).unwrap_or_else(|e| {
        panic!(
            "a configuration does not read back ({e}): {}",
            String::from_utf8_lossy(&json)
        )
    });
    assert_eq!(&back, cfg, "a configuration changed through JSON");
    let _ = cfg.ebpf_unsupported();
    let _ = cfg.include_covers_loopback();
}

/// An error must name what was wrong as it was given: the annotation and its whole value, or the
/// mesh setting.
pub fn check_error(spec: &PodSpec, error: &ConfigError) {
    let shown = error.to_string();
    match error {
        ConfigError::Annotation { key, value, reason }
        | ConfigError::Unsupported { key, value, reason } => {
            assert_eq!(
                spec.annotations.get(key),
                Some(value),
                "error names {key}={value:?}, which the pod does not have: {shown}"
            );
            assert!(!reason.is_empty(), "no reason given: {shown}");
        }
        ConfigError::OwnerGroups { value, reason } => {
            let given = [
                spec.mesh.owner_groups.as_deref(),
                spec.mesh.owner_groups_exclude.as_deref(),
            ];
            assert!(
                given.contains(&Some(value.as_str())),
                "error names owner groups {value:?}, which were not given: {shown}"
            );
            assert!(!reason.is_empty(), "no reason given: {shown}");
        }
        ConfigError::Pod(reason) => assert!(!reason.is_empty()),
        ConfigError::Mesh(reason) => assert!(
            spec.mesh_config.is_some() && !reason.is_empty(),
            "a mesh configuration's error for a pod without one: {shown}"
        ),
        ConfigError::ProxyContainer(reason) => assert!(
            spec.proxy_container.is_some() && !reason.is_empty(),
            "a proxy container's error for a pod without one: {shown}"
        ),
    }
}

/// Validates `spec` under every set of defaults and checks what comes out. The defaults change
/// which ports are excluded and what is captured when nothing is named, never whether a pod is
/// accepted or what its error says.
pub fn validate(spec: &mut PodSpec) -> Result<CaptureConfig, ConfigError> {
    let first = CaptureConfig::from_pod(spec);
    match &first {
        Ok(cfg) => check_config(spec, cfg),
        Err(e) => check_error(spec, e),
    }
    let given = spec.defaults;
    for defaults in [
        Defaults::IstioInit,
        Defaults::IstioCni,
        Defaults::IstioIptables,
    ] {
        if defaults == given {
            continue;
        }
        spec.defaults = defaults;
        let other = CaptureConfig::from_pod(spec);
        match (&first, &other) {
            (Ok(_), Ok(cfg)) => check_config(spec, cfg),
            (Err(a), Err(b)) => assert_eq!(a, b, "the defaults changed the error"),
            _ => panic!("the defaults decide acceptance: {first:?} / {other:?}"),
        }
    }
    spec.defaults = given;
    first
}
