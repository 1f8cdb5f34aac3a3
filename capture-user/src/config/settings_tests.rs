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
