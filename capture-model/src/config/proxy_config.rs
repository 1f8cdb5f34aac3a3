//! The pod's `proxy.istio.io/config` (YAML or JSON): the ProxyConfig fields that decide capture,
//! which Istio's injector merges over the mesh's `defaultConfig` (`mesh.MergeProxyConfig`).

use std::collections::BTreeMap;

use super::{
    mesh_config::{DNS_CAPTURE, INVALID_DROP},
    values::bad,
    ConfigError, ANN_PROXY_CONFIG,
};

/// What a pod's `proxy.istio.io/config` says, as written.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub(super) struct ProxyConfigAnnotation {
    pub interception_mode: Option<String>,
    /// The proxyMetadata keys capture reads.
    pub metadata: BTreeMap<&'static str, String>,
}

impl ProxyConfigAnnotation {
    pub fn parse(text: &str) -> Result<Self, ConfigError> {
        let bad_yaml = |reason: String| bad(ANN_PROXY_CONFIG, text, reason);
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|e| bad_yaml(format!("not YAML or JSON: {e}")))?;
        let mut parsed = Self::default();
        if let Some(mode) = doc.get("interceptionMode") {
            let mode = mode.as_str().ok_or_else(|| {
                bad_yaml(format!(
                    "interceptionMode is {mode:?}, not REDIRECT or TPROXY"
                ))
            })?;
            parsed.interception_mode = Some(mode.to_string());
        }
        let Some(metadata) = doc.get("proxyMetadata") else {
            return Ok(parsed);
        };
        for key in [DNS_CAPTURE, INVALID_DROP] {
            let Some(v) = metadata.get(key) else {
                continue;
            };
            let s = match v {
                serde_yaml_ng::Value::String(s) => s.clone(),
                serde_yaml_ng::Value::Bool(b) => b.to_string(),
                other => {
                    return Err(bad_yaml(format!(
                        "proxyMetadata.{key} is {other:?}, not \"true\" or \"false\""
                    )))
                }
            };
            parse_switch(&s).ok_or_else(|| {
                bad_yaml(format!("proxyMetadata.{key}={s:?} is not true or false"))
            })?;
            parsed.metadata.insert(key, s);
        }
        Ok(parsed)
    }
}

/// A proxyMetadata switch as a pod's annotation may give it.
pub(super) fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "true" | "1" => Some(true),
        "false" | "0" | "" => Some(false),
        _ => None,
    }
}
