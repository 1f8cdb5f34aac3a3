//! The pod's proxy container as the runtime created it: where istio-cni takes a pod's settings
//! from (`ExtractPodInfo` in `cni/pkg/plugin/kubernetes.go`: the `istio-proxy` container's
//! environment and its `runAsUser`/`runAsGroup`; `NewRedirect` in `sidecar_redirect.go`). The
//! injector fills that environment from the merged ProxyConfig (the revision's mesh
//! configuration, ProxyConfig resources, the pod's `proxy.istio.io/config`), so once the
//! container exists it is the most specific word on DNS capture and invalid-packet drops.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{
    mesh_config::{go_parse_bool, DNS_CAPTURE, INVALID_DROP},
    ConfigError, DEFAULT_PROXY_ID,
};

/// The proxy's interception mode, as the injector passes it (`ISTIO_META_INTERCEPTION_MODE`).
pub const INTERCEPTION_MODE_ENV: &str = "ISTIO_META_INTERCEPTION_MODE";
/// The environment variables capture reads.
pub const READ_ENV: [&str; 3] = [DNS_CAPTURE, INVALID_DROP, INTERCEPTION_MODE_ENV];

/// What the runtime says of the proxy container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ProxyContainerConfig {
    /// Its name in the pod spec (`istio-proxy`).
    pub name: String,
    pub container_id: String,
    /// The variables of [`READ_ENV`] it sets, as written.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub env: BTreeMap<String, String>,
    /// Its security context's `runAsUser` and `runAsGroup`, where set (the kubelet's, which
    /// folds the pod's in).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_user: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_as_group: Option<i64>,
}

impl ProxyContainerConfig {
    /// Where a setting came from in it, for `capture status` (whose source says `proxy env`).
    #[must_use]
    pub fn env_source(&self, key: &str) -> String {
        format!("{} {key}", self.name)
    }

    /// A switch of its environment, read as istio-cni and the proxy read it (Go's
    /// `strconv.ParseBool`); unset is off, as for istio-cni. A value that is no boolean is
    /// refused, naming the variable.
    ///
    /// # Errors
    /// The value is not one of Go's booleans.
    pub fn switch(&self, key: &str) -> Result<bool, ConfigError> {
        match self.env.get(key) {
            None => Ok(false),
            Some(value) => env_switch(&self.env_source(key), value),
        }
    }

    /// The proxy's uid to istio-cni: `runAsUser` unless unset or 0.
    ///
    /// # Errors
    /// The value is no uid.
    pub fn uid(&self) -> Result<Option<u32>, ConfigError> {
        self.id("runAsUser", self.run_as_user)
    }

    /// The proxy's gid to istio-cni: `runAsGroup` unless unset or 0, then 1337.
    ///
    /// # Errors
    /// The value is no gid.
    pub fn gid(&self) -> Result<u32, ConfigError> {
        Ok(self
            .id("runAsGroup", self.run_as_group)?
            .unwrap_or(DEFAULT_PROXY_ID))
    }

    fn id(&self, field: &str, value: Option<i64>) -> Result<Option<u32>, ConfigError> {
        match value {
            None | Some(0) => Ok(None),
            Some(id) => u32::try_from(id).map(Some).map_err(|_| {
                ConfigError::ProxyContainer(format!(
                    "{} securityContext.{field}={id} is not a uid or gid",
                    self.name
                ))
            }),
        }
    }
}

/// A proxy environment variable's boolean, `from` naming it.
///
/// # Errors
/// The value is not one of Go's booleans.
pub fn env_switch(from: &str, value: &str) -> Result<bool, ConfigError> {
    go_parse_bool(value).ok_or_else(|| {
        ConfigError::ProxyContainer(format!(
            "its environment's {from}={value:?} is not a boolean (Go's strconv.ParseBool: 1, t, T, TRUE, true, True, 0, f, F, FALSE, false, False); fix the proxy's environment (the mesh's or the pod's proxyMetadata) and recreate the pod"
        ))
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proxy(env: &[(&str, &str)], uid: Option<i64>, gid: Option<i64>) -> ProxyContainerConfig {
        ProxyContainerConfig {
            name: "istio-proxy".into(),
            container_id: "c".into(),
            env: env
                .iter()
                .map(|(k, v)| ((*k).into(), (*v).into()))
                .collect(),
            run_as_user: uid,
            run_as_group: gid,
        }
    }

    #[test]
    fn switches_are_go_booleans_and_unset_is_off() {
        assert_eq!(
            proxy(&[(DNS_CAPTURE, "true")], None, None).switch(DNS_CAPTURE),
            Ok(true)
        );
        assert_eq!(
            proxy(&[(DNS_CAPTURE, "T")], None, None).switch(DNS_CAPTURE),
            Ok(true)
        );
        assert_eq!(proxy(&[], None, None).switch(DNS_CAPTURE), Ok(false));
        let e = proxy(&[(INVALID_DROP, "yes")], None, None)
            .switch(INVALID_DROP)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("istio-proxy INVALID_DROP=\"yes\"") && e.contains("ParseBool"),
            "{e}"
        );
    }

    #[test]
    fn ids_are_istio_cnis() {
        // runAsUser 0 or unset: the default proxy uid (istio-cni's custom-uid-zero case).
        assert_eq!(proxy(&[], Some(0), None).uid(), Ok(None));
        assert_eq!(proxy(&[], None, None).uid(), Ok(None));
        assert_eq!(
            proxy(&[], Some(1_000_680_000), None).uid(),
            Ok(Some(1_000_680_000))
        );
        assert_eq!(proxy(&[], Some(1_000_680_000), None).gid(), Ok(1337));
        assert_eq!(
            proxy(&[], None, Some(1_000_670_001)).gid(),
            Ok(1_000_670_001)
        );
        assert!(proxy(&[], Some(-1), None).uid().is_err());
    }
}
