//! The pod's `proxy.istio.io/config` (YAML or JSON): what it says about DNS capture, over the
//! mesh default.

use super::{
    values::bad, ConfigError, DnsCapture, PodSpec, ANN_PROXY_CONFIG, DNS_CAPTURE_METADATA, DNS_PORT,
};

/// Is DNS capture on for this pod? The pod's `proxy.istio.io/config` proxyMetadata overrides the
/// mesh default. On, without capture-all and without nameservers, it is off (as Istio's).
pub(super) fn dns_capture(
    spec: &PodSpec,
    proxy_config: Option<&str>,
) -> Result<Option<DnsCapture>, ConfigError> {
    let mut on = spec.mesh.redirect_dns;
    if let Some(text) = proxy_config {
        let bad_yaml = |reason: String| bad(ANN_PROXY_CONFIG, text, reason);
        let doc: serde_yaml_ng::Value = serde_yaml_ng::from_str(text)
            .map_err(|e| bad_yaml(format!("not YAML or JSON: {e}")))?;
        if let Some(v) = doc
            .get("proxyMetadata")
            .and_then(|m| m.get(DNS_CAPTURE_METADATA))
        {
            let s = match v {
                serde_yaml_ng::Value::String(s) => s.clone(),
                serde_yaml_ng::Value::Bool(b) => b.to_string(),
                other => {
                    return Err(bad_yaml(format!(
                    "proxyMetadata.{DNS_CAPTURE_METADATA} is {other:?}, not \"true\" or \"false\""
                )))
                }
            };
            on = match s.trim().to_ascii_lowercase().as_str() {
                "true" | "1" => true,
                "false" | "0" | "" => false,
                _ => {
                    return Err(bad_yaml(format!(
                        "proxyMetadata.{DNS_CAPTURE_METADATA}={s:?} is not true or false"
                    )))
                }
            };
        }
    }
    if !on || (!spec.mesh.capture_all_dns && spec.mesh.nameservers.is_empty()) {
        return Ok(None);
    }
    Ok(Some(DnsCapture {
        capture_all: spec.mesh.capture_all_dns,
        nameservers: spec.mesh.nameservers.clone(),
        port: DNS_PORT,
    }))
}
