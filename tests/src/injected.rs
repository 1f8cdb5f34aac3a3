//! Pod annotations as Istio's injector writes them (the templates under
//! `manifests/charts/istio-control/istio-discovery/files/` in istio/istio, the status as
//! `pkg/kube/inject` serialises it), for each kind of pod istio-cni tells apart.

/// The sidecar template with Istio's CNI on: istio-validation instead of istio-init.
pub const SIDECAR: &[(&str, &str)] = &[
    ("istio.io/rev", "default"),
    ("kubectl.kubernetes.io/default-container", "app"),
    (
        "sidecar.istio.io/status",
        r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
    ),
];
/// The same with Kubernetes' native sidecars: the proxy is an init container.
pub const NATIVE_SIDECAR: &[(&str, &str)] = &[
    ("istio.io/rev", "default"),
    (
        "sidecar.istio.io/status",
        r#"{"initContainers":["istio-validation","istio-proxy"],"containers":null,"volumes":["workload-socket","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
    ),
];
/// The sidecar template without Istio's CNI: istio-init writes Istio's rules itself.
pub const ISTIO_INIT: &[(&str, &str)] = &[
    ("istio.io/rev", "default"),
    (
        "sidecar.istio.io/status",
        r#"{"initContainers":["istio-init"],"containers":["istio-proxy"],"volumes":["workload-socket","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
    ),
];
/// A gateway of Istio's gateway chart (its podAnnotations), injected with the gateway
/// template: the proxy runs `proxy router` and serves the pod's ports itself.
pub const GATEWAY: &[(&str, &str)] = &[
    ("inject.istio.io/templates", "gateway"),
    ("sidecar.istio.io/inject", "true"),
    ("prometheus.io/port", "15020"),
    ("prometheus.io/scrape", "true"),
    ("prometheus.io/path", "/stats/prometheus"),
    ("istio.io/rev", "default"),
    (
        "sidecar.istio.io/status",
        r#"{"initContainers":null,"containers":["istio-proxy"],"volumes":["workload-socket","credential-socket","workload-certs","istio-envoy","istio-data","istio-podinfo","istio-token","istiod-ca-cert"],"imagePullSecrets":null,"revision":"default"}"#,
    ),
];
