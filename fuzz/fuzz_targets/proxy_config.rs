//! The `proxy.istio.io/config` annotation (YAML or JSON), alone, through pod validation.

#![no_main]

use capture_model::config::{CaptureConfig, ConfigError, ANN_PROXY_CONFIG};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut spec = capture_fuzz::pod_spec("");
    spec.annotations
        .insert(ANN_PROXY_CONFIG.into(), text.into());
    spec.mesh.nameservers = vec!["10.96.0.10".parse().unwrap()];
    let off_by_default = capture_fuzz::validate(&mut spec);
    spec.mesh.redirect_dns = true;
    let on_by_default = CaptureConfig::from_pod(&spec);
    match (&off_by_default, &on_by_default) {
        // The mesh default is only a default: the YAML is read, and accepted or refused, the same.
        (Ok(off), Ok(on)) => assert!(
            off.dns.is_none() || on.dns.is_some(),
            "DNS capture is on with the mesh default off, and off with it on"
        ),
        (Err(a), Err(b)) => assert_eq!(a, b),
        _ => panic!("the mesh default decides acceptance: {off_by_default:?} / {on_by_default:?}"),
    }
    // The annotation is "YAML or JSON": a JSON object must be read as one (its values may still
    // be refused). Two exceptions, where Istio's reader (YAML) refuses the text as capture's
    // does: characters outside YAML's printable set, which JSON allows raw in strings, and tabs,
    // which JSON takes as white space and YAML refuses where a token starts.
    let printable = |c: char| matches!(c, '\t' | '\n' | '\r' | ' '..='~' | '\u{85}' | '\u{a0}'..='\u{d7ff}' | '\u{e000}'..='\u{fffd}' | '\u{10000}'..);
    if !text.chars().all(printable) || text.contains('\t') {
        return;
    }
    if let Ok(serde_json::Value::Object(_)) = serde_json::from_str::<serde_json::Value>(text) {
        if let Err(ConfigError::Annotation { reason, .. }) = &off_by_default {
            assert!(
                !reason.starts_with("not YAML or JSON"),
                "a JSON object is not read as proxy config: {reason}"
            );
        }
    }
});
