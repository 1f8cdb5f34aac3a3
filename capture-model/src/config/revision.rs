//! Which of Istio's control planes injected a pod: its revision, and the ConfigMap that holds that
//! revision's mesh configuration.
//!
//! The injector writes the revision into the pod's `sidecar.istio.io/status` (its `revision`
//! field, `pkg/kube/inject/webhook.go`) and into an `istio.io/rev` annotation
//! (`injection-template.yaml`), both `default` for the default revision. istiod's chart names
//! each revision's mesh configuration `istio-<revision>`, the default's `istio`
//! (`manifests/charts/istio-control/istio-discovery/templates/configmap.yaml`).

use std::collections::BTreeMap;

use serde::Deserialize;

use super::proxy_identity::ANN_SIDECAR_STATUS;

/// The annotation the injector writes with the revision.
pub const ANN_REVISION: &str = "istio.io/rev";
/// What Istio calls the revision without a name.
pub const DEFAULT_REVISION: &str = "default";
/// The default revision's mesh ConfigMap.
pub const DEFAULT_CONFIG_MAP: &str = "istio";

/// A control plane's revision: `None` is the default one.
#[derive(Clone, Debug, Default, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Revision(Option<String>);

#[derive(Deserialize)]
struct Status {
    #[serde(default)]
    revision: Option<String>,
}

impl Revision {
    /// The default revision.
    #[must_use]
    pub fn default_revision() -> Self {
        Self(None)
    }

    /// A revision by name (`default` or empty is the default one).
    #[must_use]
    pub fn named(name: &str) -> Self {
        let name = name.trim();
        if name.is_empty() || name == DEFAULT_REVISION {
            Self(None)
        } else {
            Self(Some(name.to_string()))
        }
    }

    /// The revision that injected a pod, from its annotations: the sidecar status's `revision`,
    /// else `istio.io/rev`, else the default.
    #[must_use]
    pub fn of_pod(annotations: &BTreeMap<String, String>) -> Self {
        let from_status = annotations
            .get(ANN_SIDECAR_STATUS)
            .and_then(|raw| serde_json::from_str::<Status>(raw).ok())
            .and_then(|s| s.revision);
        from_status
            .or_else(|| annotations.get(ANN_REVISION).cloned())
            .map_or_else(Self::default_revision, |name| Self::named(&name))
    }

    /// The revision named by a mesh ConfigMap's name (`istio`, `istio-<revision>`), if it is one.
    #[must_use]
    pub fn of_config_map(name: &str) -> Option<Self> {
        if name == DEFAULT_CONFIG_MAP {
            return Some(Self(None));
        }
        name.strip_prefix("istio-")
            .filter(|rev| !rev.is_empty())
            .map(Self::named)
    }

    /// The ConfigMap that holds this revision's mesh configuration.
    #[must_use]
    pub fn config_map(&self) -> String {
        match &self.0 {
            None => DEFAULT_CONFIG_MAP.to_string(),
            Some(rev) => format!("istio-{rev}"),
        }
    }

    /// Its name as Istio writes it (`default` for the default one).
    #[must_use]
    pub fn name(&self) -> &str {
        self.0.as_deref().unwrap_or(DEFAULT_REVISION)
    }

    #[must_use]
    pub fn is_default(&self) -> bool {
        self.0.is_none()
    }
}

impl std::fmt::Display for Revision {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ann(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect()
    }

    #[test]
    fn the_status_names_the_revision_before_the_annotation() {
        let status = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"revision":"canary"}"#;
        let pod = ann(&[(ANN_SIDECAR_STATUS, status), (ANN_REVISION, "other")]);
        assert_eq!(Revision::of_pod(&pod), Revision::named("canary"));
        assert_eq!(Revision::of_pod(&pod).config_map(), "istio-canary");
        let pod = ann(&[(ANN_REVISION, "1-24-0")]);
        assert_eq!(Revision::of_pod(&pod).config_map(), "istio-1-24-0");
        for default in [
            ann(&[]),
            ann(&[(ANN_REVISION, "default")]),
            ann(&[(ANN_SIDECAR_STATUS, r#"{"revision":"default"}"#)]),
            ann(&[(ANN_SIDECAR_STATUS, "not json"), (ANN_REVISION, "")]),
        ] {
            let rev = Revision::of_pod(&default);
            assert!(rev.is_default(), "{default:?}");
            assert_eq!(rev.config_map(), "istio");
            assert_eq!(rev.name(), "default");
        }
    }

    #[test]
    fn config_map_names_give_their_revision() {
        assert_eq!(
            Revision::of_config_map("istio"),
            Some(Revision::default_revision())
        );
        assert_eq!(
            Revision::of_config_map("istio-canary"),
            Some(Revision::named("canary"))
        );
        assert_eq!(Revision::of_config_map("istio-"), None);
        assert_eq!(Revision::of_config_map("mesh"), None);
    }
}
