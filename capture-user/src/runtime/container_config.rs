//! A container's configuration as the runtime reports it in `ContainerStatus`'s verbose info:
//! the environment and ids istio-cni reads from the pod's proxy container.
//!
//! containerd puts the CRI `ContainerConfig` it was created with there (`info.config`: `envs`,
//! `linux.security_context.run_as_user`, which the kubelet fills from the container's and the
//! pod's security context) beside the OCI runtime spec (`info.runtimeSpec`); CRI-O the runtime
//! spec alone, whose `process.user.uid` is the user the process runs as (the image's where no
//! `runAsUser` is set).

use std::{
    collections::{BTreeMap, HashMap},
    hash::BuildHasher,
};

use serde_json::Value;

use crate::config::{proxy_container::READ_ENV, ProxyContainerConfig};

/// The proxy container's settings from a verbose `ContainerStatus`'s `info`.
#[must_use]
pub fn from_verbose_info<S: BuildHasher>(
    name: &str,
    container_id: &str,
    info: &HashMap<String, String, S>,
) -> ProxyContainerConfig {
    let parsed: Value = info
        .get("info")
        .and_then(|raw| serde_json::from_str(raw).ok())
        .unwrap_or_default();
    let config = &parsed["config"];
    let spec = &parsed["runtimeSpec"];
    let mut env = BTreeMap::new();
    let wanted = |key: &str| READ_ENV.contains(&key);
    if let Some(envs) = config["envs"].as_array() {
        for kv in envs {
            if let (Some(k), Some(v)) = (kv["key"].as_str(), kv["value"].as_str()) {
                if wanted(k) {
                    env.insert(k.to_string(), v.to_string());
                }
            }
        }
    } else if let Some(envs) = spec["process"]["env"].as_array() {
        for kv in envs.iter().filter_map(Value::as_str) {
            if let Some((k, v)) = kv.split_once('=').filter(|(k, _)| wanted(k)) {
                env.insert(k.to_string(), v.to_string());
            }
        }
    }
    let context = &config["linux"]["security_context"];
    let (run_as_user, run_as_group) = if config.is_object() {
        (
            context["run_as_user"]["value"].as_i64(),
            context["run_as_group"]["value"].as_i64(),
        )
    } else {
        (
            spec["process"]["user"]["uid"].as_i64(),
            spec["process"]["user"]["gid"].as_i64(),
        )
    };
    ProxyContainerConfig {
        name: name.to_string(),
        container_id: container_id.to_string(),
        env,
        run_as_user,
        run_as_group,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// What containerd 1.6's `ContainerStatus` says of a proxy container (trimmed).
    const CONTAINERD: &str = r#"{"sandboxID":"abc","pid":4242,"config":{"metadata":{"name":"istio-proxy"},"image":{"image":"proxyv2"},"envs":[{"key":"ISTIO_META_DNS_CAPTURE","value":"true"},{"key":"PILOT_CERT_PROVIDER","value":"istiod"},{"key":"INVALID_DROP","value":"false"}],"linux":{"security_context":{"run_as_user":{"value":1000680000},"run_as_group":{"value":1000680001}}}},"runtimeSpec":{"process":{"user":{"uid":1000680000,"gid":1000680001},"env":["PATH=/usr/bin","ISTIO_META_DNS_CAPTURE=true"]}}}"#;

    #[test]
    fn containerd_gives_the_cri_config() {
        let info = HashMap::from([("info".to_string(), CONTAINERD.to_string())]);
        let proxy = from_verbose_info("istio-proxy", "c1", &info);
        assert_eq!(
            proxy.env,
            BTreeMap::from([
                ("INVALID_DROP".to_string(), "false".to_string()),
                ("ISTIO_META_DNS_CAPTURE".to_string(), "true".to_string()),
            ])
        );
        assert_eq!(
            (proxy.run_as_user, proxy.run_as_group),
            (Some(1_000_680_000), Some(1_000_680_001))
        );
    }

    #[test]
    fn without_the_cri_config_the_runtime_spec_is_read() {
        let crio = r#"{"pid":7,"runtimeSpec":{"process":{"user":{"uid":1337,"gid":1337},"env":["ISTIO_META_INTERCEPTION_MODE=TPROXY","HOME=/"]}}}"#;
        let info = HashMap::from([("info".to_string(), crio.to_string())]);
        let proxy = from_verbose_info("istio-proxy", "c2", &info);
        assert_eq!(
            proxy
                .env
                .get("ISTIO_META_INTERCEPTION_MODE")
                .map(String::as_str),
            Some("TPROXY")
        );
        assert_eq!(proxy.run_as_user, Some(1337));
        // No info at all: nothing known, nothing set.
        let bare = from_verbose_info("istio-proxy", "c3", &HashMap::new());
        assert!(bare.env.is_empty() && bare.run_as_user.is_none());
    }
}
