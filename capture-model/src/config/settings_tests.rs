//! Where each setting comes from: annotation over mesh over flag over default.

use super::{
    settings::{Setting, Source},
    CaptureConfig, ConfigError, InterceptionMode, MeshConfig, MeshDefaults, PodSpec,
    ANN_INTERCEPTION_MODE, ANN_PROXY_CONFIG,
};

fn spec(annotations: &[(&str, &str)], mesh: Option<&str>, flags: MeshDefaults) -> PodSpec {
    PodSpec {
        mesh: flags,
        mesh_config: mesh.map(|text| MeshConfig::parse(text).unwrap()),
        ..super::tests::spec(annotations)
    }
}

fn capture_all_flags(redirect_dns: bool) -> MeshDefaults {
    MeshDefaults {
        redirect_dns,
        capture_all_dns: true,
        ..MeshDefaults::default()
    }
}

fn setting<'a>(settings: &'a [Setting], name: &str) -> &'a Setting {
    settings.iter().find(|s| s.name == name).unwrap()
}

const MESH_DNS_ON: &str =
    "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n";
const POD_DNS_OFF: &str = "proxyMetadata:\n  ISTIO_META_DNS_CAPTURE: \"false\"\n";

#[test]
fn the_mesh_turns_dns_capture_on_and_a_pod_turns_it_off() {
    let (on, settings) = CaptureConfig::from_pod_with_settings(&spec(
        &[],
        Some(MESH_DNS_ON),
        capture_all_flags(false),
    ))
    .unwrap();
    assert!(on.dns.is_some_and(|d| d.capture_all));
    let dns = setting(&settings, "dns_capture");
    assert_eq!((dns.value.as_str(), dns.source), ("true", Source::Mesh));
    assert_eq!(
        dns.from,
        "defaultConfig.proxyMetadata.ISTIO_META_DNS_CAPTURE"
    );

    let (off, settings) = CaptureConfig::from_pod_with_settings(&spec(
        &[(ANN_PROXY_CONFIG, POD_DNS_OFF)],
        Some(MESH_DNS_ON),
        capture_all_flags(false),
    ))
    .unwrap();
    assert_eq!(off.dns, None);
    let dns = setting(&settings, "dns_capture");
    assert_eq!(
        (dns.value.as_str(), dns.source),
        ("false", Source::Annotation)
    );
    assert_eq!(dns.overrides.len(), 1, "{dns:?}");
    assert_eq!(
        (dns.overrides[0].source, dns.overrides[0].value.as_str()),
        (Source::Mesh, "true")
    );
}

#[test]
fn the_mesh_wins_over_the_flags_and_the_flags_over_the_default() {
    let mesh_off = "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"false\"\n    INVALID_DROP: \"true\"\n";
    let (c, settings) =
        CaptureConfig::from_pod_with_settings(&spec(&[], Some(mesh_off), capture_all_flags(true)))
            .unwrap();
    assert_eq!(c.dns, None);
    assert!(c.drop_invalid);
    let dns = setting(&settings, "dns_capture");
    assert_eq!(dns.source, Source::Mesh);
    assert_eq!(dns.overrides[0].from, "--redirect-dns");
    assert_eq!(setting(&settings, "drop_invalid").source, Source::Mesh);

    let (c, settings) =
        CaptureConfig::from_pod_with_settings(&spec(&[], None, capture_all_flags(true))).unwrap();
    assert!(c.dns.is_some());
    assert_eq!(setting(&settings, "dns_capture").source, Source::Flag);
    let (c, settings) =
        CaptureConfig::from_pod_with_settings(&spec(&[], None, MeshDefaults::default())).unwrap();
    assert!(c.dns.is_none() && !c.drop_invalid);
    assert_eq!(setting(&settings, "dns_capture").source, Source::Default);
    assert_eq!(setting(&settings, "interception_mode").value, "REDIRECT");
}

#[test]
fn interception_mode_annotation_then_proxy_config_then_mesh() {
    let mesh = "defaultConfig:\n  interceptionMode: TPROXY\n";
    let mode = |annotations: &[(&str, &str)], mesh: Option<&str>| {
        let (c, settings) = CaptureConfig::from_pod_with_settings(&spec(
            annotations,
            mesh,
            MeshDefaults::default(),
        ))
        .unwrap();
        let s = setting(&settings, "interception_mode").clone();
        (c.interception_mode, s.source, s.from)
    };
    assert_eq!(
        mode(&[], Some(mesh)),
        (
            InterceptionMode::Tproxy,
            Source::Mesh,
            "defaultConfig.interceptionMode".into()
        )
    );
    assert_eq!(
        mode(&[(ANN_INTERCEPTION_MODE, "REDIRECT")], Some(mesh)),
        (
            InterceptionMode::Redirect,
            Source::Annotation,
            ANN_INTERCEPTION_MODE.into()
        )
    );
    assert_eq!(
        mode(
            &[(ANN_PROXY_CONFIG, "interceptionMode: REDIRECT")],
            Some(mesh)
        )
        .0,
        InterceptionMode::Redirect
    );
    assert_eq!(
        mode(&[(ANN_PROXY_CONFIG, "interceptionMode: TPROXY")], None).0,
        InterceptionMode::Tproxy
    );
}

#[test]
fn a_mesh_mode_capture_cannot_serve_fails_only_the_pods_that_take_it() {
    let none = "defaultConfig:\n  interceptionMode: NONE\n";
    let e = CaptureConfig::from_pod(&spec(&[], Some(none), MeshDefaults::default())).unwrap_err();
    assert!(
        matches!(&e, ConfigError::Mesh(why) if why.contains("\"NONE\"")),
        "{e}"
    );
    assert!(CaptureConfig::from_pod(&spec(
        &[(ANN_INTERCEPTION_MODE, "REDIRECT")],
        Some(none),
        MeshDefaults::default()
    ))
    .is_ok());
}

/// A pod's acceptance never depends on the mesh or the flags: a bad annotation is refused even
/// where a more specific one decides the setting.
#[test]
fn bad_annotations_are_refused_whatever_the_mesh_says() {
    for mesh in [None, Some(MESH_DNS_ON)] {
        let e = CaptureConfig::from_pod(&spec(
            &[
                (ANN_INTERCEPTION_MODE, "REDIRECT"),
                (ANN_PROXY_CONFIG, "interceptionMode: SIDEWAYS"),
            ],
            mesh,
            MeshDefaults::default(),
        ))
        .unwrap_err();
        assert!(
            matches!(&e, ConfigError::Annotation { key, reason, .. } if key == ANN_PROXY_CONFIG && reason.contains("SIDEWAYS")),
            "{e}"
        );
    }
}

fn with_proxy(
    mut spec: PodSpec,
    env: &[(&str, &str)],
    run_as: (Option<i64>, Option<i64>),
) -> PodSpec {
    spec.proxy_container = Some(super::ProxyContainerConfig {
        name: "istio-proxy".into(),
        container_id: "c0ffee".into(),
        env: env
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        run_as_user: run_as.0,
        run_as_group: run_as.1,
    });
    spec
}

#[test]
fn the_proxy_containers_environment_is_istio_cnis_word_on_dns_and_drops() {
    // The mesh of the pod's revision says DNS capture on; its proxy's environment says off, as
    // a ProxyConfig resource may have made it: the environment wins.
    let mut base = spec(&[], Some(MESH_DNS_ON), capture_all_flags(false));
    base.mesh_source = Some("istio-canary".into());
    let (at_add, settings) = CaptureConfig::from_pod_with_settings(&base).unwrap();
    assert!(at_add.dns.is_some());
    assert_eq!(
        setting(&settings, "dns_capture").from,
        "istio-canary defaultConfig.proxyMetadata.ISTIO_META_DNS_CAPTURE"
    );
    let off = with_proxy(
        base.clone(),
        &[("ISTIO_META_DNS_CAPTURE", "false")],
        (None, None),
    );
    let (cfg, settings) = CaptureConfig::from_pod_with_settings(&off).unwrap();
    assert_eq!(cfg.dns, None);
    let dns = setting(&settings, "dns_capture");
    assert_eq!(
        (dns.source, dns.from.as_str()),
        (Source::ProxyEnv, "istio-proxy ISTIO_META_DNS_CAPTURE")
    );
    assert_eq!(dns.overrides[0].source, Source::Mesh);
    // Unset in the environment is off, as istio-cni reads it, whatever the mesh and flags say.
    let unset = with_proxy(
        spec(&[], Some(MESH_DNS_ON), capture_all_flags(true)),
        &[],
        (None, None),
    );
    assert_eq!(CaptureConfig::from_pod(&unset).unwrap().dns, None);
    // And on where the environment says so, over a mesh that says nothing.
    let on = with_proxy(
        spec(&[], None, capture_all_flags(false)),
        &[("ISTIO_META_DNS_CAPTURE", "true"), ("INVALID_DROP", "1")],
        (None, None),
    );
    let cfg = CaptureConfig::from_pod(&on).unwrap();
    assert!(cfg.dns.is_some() && cfg.drop_invalid);
}

#[test]
fn a_proxy_variable_that_is_no_boolean_is_refused_by_name() {
    let bad = with_proxy(
        spec(&[], None, capture_all_flags(false)),
        &[("ISTIO_META_DNS_CAPTURE", "yes")],
        (None, None),
    );
    let e = CaptureConfig::from_pod(&bad).unwrap_err();
    assert!(matches!(e, ConfigError::ProxyContainer(_)), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("istio-proxy ISTIO_META_DNS_CAPTURE=\"yes\""),
        "{text}"
    );
}

#[test]
fn the_proxy_runs_as_its_security_context_says() {
    let flags = MeshDefaults::default();
    // OpenShift's range: the proxy's uid, and istio-cni's 1337 for the unset group.
    let openshift = with_proxy(
        spec(&[], None, flags.clone()),
        &[],
        (Some(1_000_680_000), None),
    );
    let (cfg, settings) = CaptureConfig::from_pod_with_settings(&openshift).unwrap();
    assert_eq!(
        (cfg.proxy_uids.as_slice(), cfg.proxy_gids.as_slice()),
        (&[1_000_680_000][..], &[1337][..])
    );
    let uid = setting(&settings, "proxy_uids");
    assert_eq!(
        (uid.source, uid.from.as_str()),
        (Source::ProxySecurityContext, "istio-proxy runAsUser")
    );
    // Both given (istio-cni's custom-uid case).
    let both = with_proxy(
        spec(&[], None, flags.clone()),
        &[],
        (Some(1_000_670_000), Some(1_000_670_001)),
    );
    let cfg = CaptureConfig::from_pod(&both).unwrap();
    assert_eq!(
        (cfg.proxy_uids, cfg.proxy_gids),
        (vec![1_000_670_000], vec![1_000_670_001])
    );
    // runAsUser 0 is no proxy uid to istio-cni (custom-uid-zero): the default.
    let zero = with_proxy(spec(&[], None, flags.clone()), &[], (Some(0), None));
    let cfg = CaptureConfig::from_pod(&zero).unwrap();
    assert_eq!((cfg.proxy_uids, cfg.proxy_gids), (vec![1337], vec![1337]));
    // The pod's own annotation (where the policy allows it) names it over the container.
    let annotated = with_proxy(
        spec(&[(super::policy::ANN_PROXY_UID, "2000")], None, flags),
        &[],
        (Some(1_000_680_000), None),
    );
    let cfg = CaptureConfig::from_pod(&annotated).unwrap();
    assert_eq!((cfg.proxy_uids, cfg.proxy_gids), (vec![2000], vec![2000]));
    // The node's flag counts only where the container says nothing.
    let flagged = MeshDefaults::default();
    let mut node = spec(&[], None, flagged);
    node.proxy_uids = vec![1337, 1338];
    assert_eq!(
        CaptureConfig::from_pod(&node).unwrap().proxy_uids,
        vec![1337, 1338]
    );
    let over = with_proxy(node, &[], (Some(1_000_680_000), None));
    assert_eq!(
        CaptureConfig::from_pod(&over).unwrap().proxy_uids,
        vec![1_000_680_000]
    );
}

#[test]
fn the_interception_mode_annotation_stays_first_then_the_proxys_environment() {
    let annotated = with_proxy(
        spec(
            &[(ANN_INTERCEPTION_MODE, "REDIRECT")],
            None,
            capture_all_flags(false),
        ),
        &[("ISTIO_META_INTERCEPTION_MODE", "TPROXY")],
        (None, None),
    );
    let cfg = CaptureConfig::from_pod(&annotated).unwrap();
    assert_eq!(cfg.interception_mode, InterceptionMode::Redirect);
    let env_only = with_proxy(
        spec(&[], None, capture_all_flags(false)),
        &[("ISTIO_META_INTERCEPTION_MODE", "TPROXY")],
        (None, None),
    );
    let (cfg, settings) = CaptureConfig::from_pod_with_settings(&env_only).unwrap();
    assert_eq!(cfg.interception_mode, InterceptionMode::Tproxy);
    assert_eq!(
        setting(&settings, "interception_mode").source,
        Source::ProxyEnv
    );
}
