use super::*;

pub(super) fn spec(annotations: &[(&str, &str)]) -> PodSpec {
    PodSpec::of_annotations(&["10.1.0.10"], annotations)
}

#[test]
fn injected_sidecar_defaults() {
    let c = CaptureConfig::from_pod(&spec(&[])).unwrap();
    assert_eq!(c.proxy_uids, vec![1337]);
    assert_eq!(c.proxy_gids, vec![1337]);
    assert_eq!(c.include_outbound_cidrs, Selection::All);
    assert!(c.exclude_outbound_cidrs.is_empty() && c.exclude_outbound_ports.is_empty());
    assert_eq!(c.include_inbound_ports, Selection::All);
    assert_eq!(c.exclude_inbound_ports, vec![15090, 15021, 15020]);
    assert_eq!(
        (c.outbound_port, c.inbound_port, c.tunnel_port),
        (15001, 15006, 15008)
    );
    assert_eq!(c.host_loopback_cidr.to_string(), "127.0.0.1/32");
}

#[test]
fn lists_drop_duplicates_and_mask_cidrs() {
    let c = CaptureConfig::from_pod(&spec(&[
        (ANN_EXCLUDE_OUTBOUND_PORTS, "80,443, 80"),
        (ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.5/8,fd00::/8"),
        (ANN_EXCLUDE_INBOUND_PORTS, "9000,15021"),
        (ANN_STATUS_PORT, "15999"),
    ]))
    .unwrap();
    assert_eq!(c.exclude_outbound_ports, vec![80, 443]);
    assert_eq!(
        c.include_outbound_cidrs,
        Selection::List(vec![
            "10.0.0.0/8".parse().unwrap(),
            "fd00::/8".parse().unwrap()
        ])
    );
    assert_eq!(c.exclude_inbound_ports, vec![15090, 15021, 9000, 15999]);
}

#[test]
fn empty_include_means_nothing() {
    let c = CaptureConfig::from_pod(&spec(&[
        (ANN_INCLUDE_OUTBOUND_CIDRS, ""),
        (ANN_INCLUDE_INBOUND_PORTS, ""),
    ]))
    .unwrap();
    assert_eq!(c.include_outbound_cidrs, Selection::List(vec![]));
    assert_eq!(c.include_inbound_ports, Selection::List(vec![]));
}

#[test]
fn loopback_include_is_detected() {
    let c =
        CaptureConfig::from_pod(&spec(&[(ANN_INCLUDE_OUTBOUND_CIDRS, "127.1.2.3/32")])).unwrap();
    assert!(c.include_covers_loopback());
    let c = CaptureConfig::from_pod(&spec(&[(ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8")])).unwrap();
    assert!(!c.include_covers_loopback());
}

#[test]
fn errors_name_the_annotation_and_value() {
    let err = |k, v| {
        CaptureConfig::from_pod(&spec(&[(k, v)]))
            .unwrap_err()
            .to_string()
    };
    let e = err(ANN_EXCLUDE_OUTBOUND_PORTS, "80,http");
    assert!(
        e.contains(ANN_EXCLUDE_OUTBOUND_PORTS) && e.contains("\"http\""),
        "{e}"
    );
    let e = err(ANN_EXCLUDE_OUTBOUND_CIDRS, "*");
    assert!(e.contains("include list"), "{e}");
    let e = err(ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.1");
    assert!(e.contains("10.0.0.1/32"), "{e}");
    // Istio's injector rejects empty list items and spaces around CIDRs; so do we.
    let e = err(ANN_EXCLUDE_OUTBOUND_PORTS, "80,,443");
    assert!(e.contains("empty item"), "{e}");
    let e = err(ANN_INCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8,");
    assert!(e.contains("empty item"), "{e}");
    let e = err(ANN_EXCLUDE_OUTBOUND_CIDRS, "10.0.0.0/8, 10.1.0.0/16");
    assert!(e.contains("spaces"), "{e}");
    let e = err(ANN_INTERCEPTION_MODE, "NONE");
    assert!(e.contains("REDIRECT or TPROXY"), "{e}");
    let e = err(ANN_KUBEVIRT_INTERFACES, "eth1,a/b");
    assert!(e.contains("\"a/b\" is not an interface name"), "{e}");
}

#[test]
fn pod_ips_and_ids_are_checked() {
    let mut s = spec(&[]);
    s.pod_ips.clear();
    assert!(CaptureConfig::from_pod(&s)
        .unwrap_err()
        .to_string()
        .contains("--pod-ip"));
    // A second address of a family is the pod's too (a second network), but not the ebpf
    // backend's: the first stays the primary, the pod falls back.
    s.pod_ips = ["10.1.0.10", "10.1.0.11", "fd00::1", "10.1.0.11"]
        .map(|a| a.parse().unwrap())
        .to_vec();
    let c = CaptureConfig::from_pod(&s).unwrap();
    assert_eq!(c.pod_ip4, Some("10.1.0.10".parse().unwrap()));
    assert_eq!(c.other_pod_ips, ["10.1.0.11".parse::<IpAddr>().unwrap()]);
    let gap = c
        .ebpf_unsupported()
        .expect("several addresses are a fallback cause");
    assert_eq!(gap.cause, FallbackCause::SeveralAddresses);
    assert!(gap.reason.contains("10.1.0.11"), "{}", gap.reason);
    let mut s = spec(&[]);
    s.proxy_uids = vec![1337, 1338];
    let c = CaptureConfig::from_pod(&s).unwrap();
    assert_eq!(c.proxy_gids, vec![1337, 1338], "gids default to the uids");
    s.proxy_gids = vec![1, 2, 3, 4, 5];
    assert!(CaptureConfig::from_pod(&s)
        .unwrap_err()
        .to_string()
        .contains("at most"));
}

#[test]
fn interfaces_and_the_ebpf_fallback() {
    let c = CaptureConfig::from_pod(&spec(&[
        (ANN_KUBEVIRT_INTERFACES, "eth1"),
        (ANN_REROUTE_VIRTUAL_INTERFACES, "eth2,eth3"),
    ]))
    .unwrap();
    assert_eq!(
        c.reroute_virtual_interfaces,
        vec!["eth2", "eth3"],
        "the newer annotation wins"
    );
    assert!(c.ebpf_unsupported().unwrap().reason.contains("eth2,eth3"));
    let c = CaptureConfig::from_pod(&spec(&[(ANN_EXCLUDE_INTERFACES, "eth9")])).unwrap();
    assert!(c
        .ebpf_unsupported()
        .unwrap()
        .reason
        .contains("excludeInterfaces"));
    assert!(CaptureConfig::from_pod(&spec(&[]))
        .unwrap()
        .ebpf_unsupported()
        .is_none());
}

#[test]
fn ipv4_loopback_cidr() {
    let mut s = spec(&[]);
    s.mesh.ipv4_loopback_cidr = Some("127.0.0.1/8".into());
    assert_eq!(
        CaptureConfig::from_pod(&s)
            .unwrap()
            .host_loopback_cidr
            .to_string(),
        "127.0.0.1/8"
    );
    for bad in ["10.0.0.0/8", "127.0.0.0/7", "x"] {
        s.mesh.ipv4_loopback_cidr = Some(bad.into());
        assert!(CaptureConfig::from_pod(&s).is_err(), "{bad}");
    }
}

fn cni_spec(annotations: &[(&str, &str)]) -> PodSpec {
    PodSpec {
        defaults: Defaults::IstioCni,
        ..spec(annotations)
    }
}

#[test]
fn the_cni_path_applies_istio_cnis_defaults() {
    // parity-spec.md A, E.21, T37: outbound 15020 is excluded unless the pod names its own exclusions.
    let c = CaptureConfig::from_pod(&cni_spec(&[])).unwrap();
    assert_eq!(c.exclude_outbound_ports, vec![15020]);
    assert_eq!(c.exclude_inbound_ports, vec![15020, 15021, 15090]);
    let c = CaptureConfig::from_pod(&cni_spec(&[(ANN_EXCLUDE_OUTBOUND_PORTS, "443")])).unwrap();
    assert_eq!(c.exclude_outbound_ports, vec![443]);
    // The annotation's ports first, then 15020, 15021, 15090, each once; the status port
    // annotation is istio-init's alone.
    let c = CaptureConfig::from_pod(&cni_spec(&[
        (ANN_EXCLUDE_INBOUND_PORTS, "9000,15021"),
        (ANN_STATUS_PORT, "15999"),
    ]))
    .unwrap();
    assert_eq!(c.exclude_inbound_ports, vec![9000, 15021, 15020, 15090]);
}

#[test]
fn the_cli_keeps_istio_inits_defaults() {
    let c = CaptureConfig::from_pod(&spec(&[])).unwrap();
    assert!(c.exclude_outbound_ports.is_empty());
    assert_eq!(c.exclude_inbound_ports, vec![15090, 15021, 15020]);
}

/// Found by the `annotations` fuzz target: the interception mode's error showed the value
/// trimmed, unlike every other annotation's error.
#[test]
fn interception_mode_error_names_the_value_as_given() {
    let given = "TPROXl\u{b}";
    let e = CaptureConfig::from_pod(&spec(&[(ANN_INTERCEPTION_MODE, given)])).unwrap_err();
    assert_eq!(
        e,
        ConfigError::Annotation {
            key: ANN_INTERCEPTION_MODE.into(),
            value: given.into(),
            reason: "must be REDIRECT or TPROXY".into(),
        }
    );
    let ok = CaptureConfig::from_pod(&spec(&[(ANN_INTERCEPTION_MODE, " TPROXY\n")])).unwrap();
    assert_eq!(ok.interception_mode, InterceptionMode::Tproxy);
}

/// Found by the `annotations` fuzz target's check that errors name their input: too many
/// excluded groups were reported as the include setting, `*`.
#[test]
fn too_many_excluded_groups_name_the_exclusions() {
    let exclude = "1,2,3,4,5,6,7,8,9";
    let mut s = spec(&[]);
    s.mesh.owner_groups_exclude = Some(exclude.into());
    match CaptureConfig::from_pod(&s).unwrap_err() {
        ConfigError::OwnerGroups { value, reason } => {
            assert_eq!(value, exclude);
            assert!(reason.starts_with("9 groups"), "{reason}");
        }
        e => panic!("{e}"),
    }
    s.mesh.owner_groups = Some(exclude.into());
    s.mesh.owner_groups_exclude = None;
    assert!(matches!(
        CaptureConfig::from_pod(&s).unwrap_err(),
        ConfigError::OwnerGroups { value, .. } if value == exclude
    ));
}
