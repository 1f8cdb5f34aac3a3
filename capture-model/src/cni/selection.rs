//! Which pods capture-cni captures: the rules istio-cni's plugin applies
//! (`cni/pkg/plugin/plugin.go`, `doAddRun`, in istio/istio), read from what reaches a CNI plugin.
//!
//! istio-cni reads the pod from the API server: its init and app containers, the istio-proxy
//! container's arguments (`proxy sidecar` or `proxy router`, `kubernetes.go`) and environment,
//! its labels. capture-cni has what the runtime passes, the pod's annotations, and reads the
//! same facts from what Istio's injector writes there: `sidecar.istio.io/status` lists the
//! containers it added (`initContainers`, `containers`; pkg/kube/inject), and
//! `inject.istio.io/templates` names the template that chose the proxy's arguments (the
//! `gateway` template of `manifests/charts/istio-control/istio-discovery/files/` runs `proxy
//! router`; Istio's gateway chart sets it on every gateway pod). The `sidecar.istio.io/inject`
//! label, which istio-cni prefers to the annotation, does not reach a CNI plugin; the pod's
//! `DISABLE_ENVOY` environment neither.

use std::collections::BTreeMap;

use serde::Deserialize;

use super::{K8sArgs, PluginConfig};
use crate::{config::mesh_config::go_parse_bool, left_alone::Reason};

pub const ANN_SIDECAR_STATUS: &str = "sidecar.istio.io/status";
pub const ANN_INJECT: &str = "sidecar.istio.io/inject";
pub const ANN_INJECT_TEMPLATES: &str = "inject.istio.io/templates";
/// The init container of Istio's injection without CNI: its iptables rules redirect the pod.
pub const ISTIO_INIT: &str = "istio-init";
/// The proxy's container (an init container where Kubernetes runs native sidecars).
pub const ISTIO_PROXY: &str = "istio-proxy";
/// The injection templates whose proxy runs as a router, not a sidecar.
const ROUTER_TEMPLATES: &[&str] = &["gateway"];

/// Why a pod is left alone (ADD succeeds without capturing it), in istio-cni's order.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Skip {
    ExcludedNamespace(String),
    /// The injector added istio-init: Istio's own rules redirect the pod already.
    IstioInit,
    /// The injector added no istio-proxy container (the containers it did add).
    NoProxyContainer(Vec<String>),
    /// The proxy is not a sidecar (the template that made it).
    NotASidecar(String),
    /// `sidecar.istio.io/inject` is false (its value).
    InjectionDisabled(String),
    NoSidecar,
}

impl std::fmt::Display for Skip {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::ExcludedNamespace(ns) => write!(f, "namespace {ns} is excluded"),
            Self::IstioInit => write!(
                f,
                "{ANN_SIDECAR_STATUS} lists {ISTIO_INIT}: Istio's own iptables rules redirect this pod, and capturing it too would redirect it twice"
            ),
            Self::NoProxyContainer(containers) => write!(
                f,
                "{ANN_SIDECAR_STATUS} lists no {ISTIO_PROXY} container (it lists {containers:?})"
            ),
            Self::NotASidecar(template) => write!(
                f,
                "its proxy is not a sidecar: {ANN_INJECT_TEMPLATES}={template} injects a router (a gateway), which serves its own ports"
            ),
            Self::InjectionDisabled(value) => write!(f, "{ANN_INJECT}={value}"),
            Self::NoSidecar => write!(
                f,
                "no {ANN_SIDECAR_STATUS} annotation (no sidecar was injected)"
            ),
        }
    }
}

impl Skip {
    /// The reason to report a skipped pod for: only pods the injector marked
    /// (`sidecar.istio.io/status`) are, since every other pod on the node is left alone too and
    /// its absence from capture says nothing.
    #[must_use]
    pub fn left_alone_reason(&self, annotations: &BTreeMap<String, String>) -> Option<Reason> {
        if sidecar_status(annotations) == Status::Absent {
            return None;
        }
        Some(match self {
            Self::IstioInit => Reason::IstioInit,
            Self::NotASidecar(_) => Reason::Gateway,
            Self::NoProxyContainer(_) => Reason::NoProxyContainer,
            Self::InjectionDisabled(_) => Reason::InjectionDisabled,
            Self::ExcludedNamespace(_) => Reason::ExcludedNamespace,
            Self::NoSidecar => return None,
        })
    }
}

/// The containers the injector added, from `sidecar.istio.io/status`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(default, rename_all = "camelCase")]
pub struct InjectedContainers {
    #[serde(deserialize_with = "null_is_empty")]
    pub init_containers: Vec<String>,
    #[serde(deserialize_with = "null_is_empty")]
    pub containers: Vec<String>,
}

/// The injector writes `null` for a list it left empty.
fn null_is_empty<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<String>, D::Error> {
    Ok(Option::<Vec<String>>::deserialize(d)?.unwrap_or_default())
}

impl InjectedContainers {
    fn is_empty(&self) -> bool {
        self.init_containers.is_empty() && self.containers.is_empty()
    }

    fn has(&self, name: &str) -> bool {
        self.init_containers
            .iter()
            .chain(&self.containers)
            .any(|c| c == name)
    }

    fn all(&self) -> Vec<String> {
        self.init_containers
            .iter()
            .chain(&self.containers)
            .cloned()
            .collect()
    }
}

/// What `sidecar.istio.io/status` says.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Status {
    Absent,
    Injected(InjectedContainers),
    /// Present but not the injector's JSON: istio-cni only asks whether the annotation is there
    /// (it reads the containers from the pod), so the pod counts as injected. Why it did not
    /// parse, for the agent to report.
    Unreadable(String),
}

#[must_use]
pub fn sidecar_status(annotations: &BTreeMap<String, String>) -> Status {
    match annotations.get(ANN_SIDECAR_STATUS) {
        None => Status::Absent,
        Some(raw) => match serde_json::from_str::<InjectedContainers>(raw) {
            Ok(injected) if !injected.is_empty() => Status::Injected(injected),
            Ok(_) => Status::Unreadable(unreadable(raw, "it names no containers")),
            Err(e) => Status::Unreadable(unreadable(raw, &e.to_string())),
        },
    }
}

fn unreadable(raw: &str, why: &str) -> String {
    format!(
        "{ANN_SIDECAR_STATUS}={raw:?} is not the injector's JSON ({why}); the pod is captured, as \
         istio-cni captures any pod that carries the annotation and an istio-proxy container"
    )
}

/// Should this pod be captured? `Some(reason)` when it must be left alone.
#[must_use]
pub fn skip_reason(
    cfg: &PluginConfig,
    pod: &K8sArgs,
    annotations: &BTreeMap<String, String>,
) -> Option<Skip> {
    if cfg.exclude_namespaces.contains(&pod.namespace) {
        return Some(Skip::ExcludedNamespace(pod.namespace.clone()));
    }
    let status = sidecar_status(annotations);
    if let Status::Injected(injected) = &status {
        if injected.has(ISTIO_INIT) {
            return Some(Skip::IstioInit);
        }
        if !injected.has(ISTIO_PROXY) {
            return Some(Skip::NoProxyContainer(injected.all()));
        }
    }
    if let Some(router) = annotations.get(ANN_INJECT_TEMPLATES).and_then(|templates| {
        templates
            .split(',')
            .map(str::trim)
            .find(|t| ROUTER_TEMPLATES.contains(t))
    }) {
        return Some(Skip::NotASidecar(router.to_string()));
    }
    if let Some(value) = annotations.get(ANN_INJECT) {
        // Go's strconv.ParseBool, as istio-cni reads it: any other value is ignored.
        if go_parse_bool(value) == Some(false) {
            return Some(Skip::InjectionDisabled(value.clone()));
        }
    }
    (status == Status::Absent).then_some(Skip::NoSidecar)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pod(ns: &str) -> K8sArgs {
        K8sArgs {
            namespace: ns.into(),
            ..K8sArgs::default()
        }
    }

    fn ann(kv: &[(&str, &str)]) -> BTreeMap<String, String> {
        kv.iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    fn skip(kv: &[(&str, &str)]) -> Option<Skip> {
        skip_reason(&PluginConfig::default(), &pod("default"), &ann(kv))
    }

    /// The status the sidecar template writes with Istio's CNI on (istio-validation).
    const SIDECAR_CNI: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#;
    /// ... without it (istio-init).
    const SIDECAR_INIT: &str = r#"{"initContainers":["istio-init"],"containers":["istio-proxy"],"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}"#;
    /// ... with native sidecars: the proxy is an init container.
    const SIDECAR_NATIVE: &str = r#"{"initContainers":["istio-validation","istio-proxy"],"containers":null,"volumes":["istio-envoy"],"imagePullSecrets":null,"revision":"default"}"#;
    /// The gateway template's.
    const GATEWAY: &str = r#"{"initContainers":null,"containers":["istio-proxy"],"volumes":["workload-socket"],"imagePullSecrets":null,"revision":"default"}"#;

    #[test]
    fn injected_sidecars_are_captured_wherever_the_proxy_container_is() {
        assert_eq!(skip(&[(ANN_SIDECAR_STATUS, SIDECAR_CNI)]), None);
        assert_eq!(skip(&[(ANN_SIDECAR_STATUS, SIDECAR_NATIVE)]), None);
        assert_eq!(
            skip(&[
                (ANN_SIDECAR_STATUS, SIDECAR_CNI),
                (ANN_INJECT_TEMPLATES, "sidecar"),
                (ANN_INJECT, "true")
            ]),
            None
        );
    }

    #[test]
    fn istio_init_pods_gateways_and_pods_without_a_proxy_are_left_alone() {
        assert_eq!(
            skip(&[(ANN_SIDECAR_STATUS, SIDECAR_INIT)]),
            Some(Skip::IstioInit)
        );
        assert_eq!(
            skip(&[
                (ANN_SIDECAR_STATUS, GATEWAY),
                (ANN_INJECT_TEMPLATES, "gateway"),
                (ANN_INJECT, "true")
            ]),
            Some(Skip::NotASidecar("gateway".into()))
        );
        assert_eq!(
            skip(&[
                (ANN_SIDECAR_STATUS, GATEWAY),
                (ANN_INJECT_TEMPLATES, "spire, gateway")
            ]),
            Some(Skip::NotASidecar("gateway".into()))
        );
        let no_proxy = r#"{"initContainers":["istio-validation"],"containers":["app-helper"]}"#;
        assert_eq!(
            skip(&[(ANN_SIDECAR_STATUS, no_proxy)]),
            Some(Skip::NoProxyContainer(vec![
                "istio-validation".into(),
                "app-helper".into()
            ]))
        );
        assert_eq!(skip(&[]), Some(Skip::NoSidecar));
        assert_eq!(
            skip_reason(
                &PluginConfig::default(),
                &pod("kube-system"),
                &ann(&[(ANN_SIDECAR_STATUS, SIDECAR_CNI)])
            ),
            Some(Skip::ExcludedNamespace("kube-system".into()))
        );
    }

    #[test]
    fn only_pods_the_injector_marked_are_reported_as_left_alone() {
        let marked = ann(&[(ANN_SIDECAR_STATUS, SIDECAR_INIT)]);
        assert_eq!(
            Skip::IstioInit.left_alone_reason(&marked),
            Some(Reason::IstioInit)
        );
        assert_eq!(
            Skip::NotASidecar("gateway".into()).left_alone_reason(&marked),
            Some(Reason::Gateway)
        );
        for unmarked in [
            Skip::ExcludedNamespace("kube-system".into()),
            Skip::InjectionDisabled("false".into()),
            Skip::NoSidecar,
        ] {
            assert_eq!(unmarked.left_alone_reason(&ann(&[])), None, "{unmarked}");
        }
    }

    #[test]
    fn the_inject_annotation_is_read_as_go_reads_a_bool() {
        for off in ["false", "False", "FALSE", "f", "F", "0"] {
            assert_eq!(
                skip(&[(ANN_SIDECAR_STATUS, SIDECAR_CNI), (ANN_INJECT, off)]),
                Some(Skip::InjectionDisabled(off.into())),
                "{off}"
            );
        }
        // Values Go's ParseBool refuses are ignored by istio-cni: the pod is captured.
        for ignored in ["fAlSe", "no", "off", " false", ""] {
            assert_eq!(
                skip(&[(ANN_SIDECAR_STATUS, SIDECAR_CNI), (ANN_INJECT, ignored)]),
                None,
                "{ignored:?}"
            );
        }
    }

    #[test]
    fn an_unreadable_status_counts_as_injected_and_says_why() {
        for raw in ["injected", "{}", r#"{"containers":null}"#, "[1]"] {
            assert_eq!(skip(&[(ANN_SIDECAR_STATUS, raw)]), None, "{raw}");
            let Status::Unreadable(why) = sidecar_status(&ann(&[(ANN_SIDECAR_STATUS, raw)])) else {
                panic!("{raw} read as the injector's");
            };
            assert!(
                why.contains(&format!("{raw:?}")) && why.contains(ANN_SIDECAR_STATUS),
                "{why}"
            );
        }
        // The istio-init skip needs a list to read it from.
        assert_eq!(
            skip(&[(ANN_SIDECAR_STATUS, r#"{"initContainers":"istio-init"}"#)]),
            None
        );
    }
}
