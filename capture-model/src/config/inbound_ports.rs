//! The inbound ports a pod has captured (the annotation's, or its defaults'), and those it never
//! has: the annotation's, and those whose defaults (the injector's, istio-cni's, istio-iptables'
//! own) always add, in their order.

use super::{
    parse_port, parse_port_selection, parse_ports, ConfigError, Defaults, PodSpec, Selection,
    ALWAYS_EXCLUDED_INBOUND_PORTS, ANN_EXCLUDE_INBOUND_PORTS, ANN_INCLUDE_INBOUND_PORTS,
    ANN_STATUS_PORT, CNI_ALWAYS_EXCLUDED_INBOUND_PORTS, DEFAULT_STATUS_PORT,
};

/// The inbound ports captured: the annotation's, else every port, except that istio-iptables
/// run without `-b` captures none.
pub(super) fn included(spec: &PodSpec) -> Result<Selection<u16>, ConfigError> {
    let annotated = spec.annotations.get(ANN_INCLUDE_INBOUND_PORTS);
    Ok(match (annotated, spec.defaults) {
        (None, Defaults::IstioIptables) => Selection::List(Vec::new()),
        (None, _) => Selection::All,
        (Some(v), _) => parse_port_selection(ANN_INCLUDE_INBOUND_PORTS, v)?,
    })
}

/// The inbound ports never captured, in the order of whose defaults fill them in, each once.
pub(super) fn excluded(spec: &PodSpec) -> Result<Vec<u16>, ConfigError> {
    let ann = |key: &str| spec.annotations.get(key).map(String::as_str);
    let status_port = match ann(ANN_STATUS_PORT) {
        None => DEFAULT_STATUS_PORT,
        Some(v) => parse_port(ANN_STATUS_PORT, v, v.trim())?,
    };
    let annotated_inbound_excludes = ann(ANN_EXCLUDE_INBOUND_PORTS)
        .map_or(Ok(Vec::new()), |v| {
            parse_ports(ANN_EXCLUDE_INBOUND_PORTS, v)
        })?;
    let mut ports = match spec.defaults {
        // The injector's order: 15090, 15021, the annotation's ports, then the status port.
        Defaults::IstioInit => [
            &ALWAYS_EXCLUDED_INBOUND_PORTS[..],
            &annotated_inbound_excludes,
            &[status_port],
        ]
        .concat(),
        // Istio CNI's: the annotation's ports, then always 15020, 15021, 15090.
        Defaults::IstioCni => [
            &annotated_inbound_excludes[..],
            &CNI_ALWAYS_EXCLUDED_INBOUND_PORTS,
        ]
        .concat(),
        Defaults::IstioIptables => annotated_inbound_excludes,
    };
    let mut seen = Vec::new();
    ports.retain(|p| {
        if seen.contains(p) {
            false
        } else {
            seen.push(*p);
            true
        }
    });
    Ok(ports)
}
