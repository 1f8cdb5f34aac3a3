//! Proxy identity: which sockets the owner rules exempt. Istio's rules exempt whatever runs as
//! the proxy's uid or gid, in any container of the pod. By container (`capture.dev/
//! proxy-identity: container`, or the node's default), the exemption holds only in the proxy
//! container's cgroup, which the agent learns from the runtime (or `attach --proxy-cgroup`).

use std::{
    os::unix::fs::MetadataExt as _,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::{values::bad, CaptureConfig, ConfigError};

/// capture's own: `container` ties the owner exemption to the proxy container, `uid` keeps
/// Istio's uid/gid semantics.
pub const ANN_PROXY_IDENTITY: &str = "capture.dev/proxy-identity";
/// The injector's record of what it added to the pod (`{"containers":["istio-proxy"],…}`); it
/// says, before any container exists, whether the pod has a proxy container at all.
pub const ANN_SIDECAR_STATUS: &str = "sidecar.istio.io/status";
/// The container Istio's injector adds (a native sidecar is an init container of that name).
pub const DEFAULT_PROXY_CONTAINER: &str = "istio-proxy";

/// How the proxy's own connections are told from the app's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[cfg_attr(feature = "cli", derive(clap::ValueEnum))]
#[serde(rename_all = "lowercase")]
pub enum ProxyIdentityMode {
    /// Istio's: the socket's owner uid or gid.
    #[default]
    Uid,
    /// The owner ids, and only from the proxy container's cgroup.
    Container,
}

impl ProxyIdentityMode {
    #[must_use]
    pub const fn as_str(self) -> &'static str {
        match self {
            Self::Uid => "uid",
            Self::Container => "container",
        }
    }
}

/// The node's side of proxy identity: its default mode and the proxy container's name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IdentityDefaults {
    pub mode: ProxyIdentityMode,
    pub container: String,
}

impl Default for IdentityDefaults {
    fn default() -> Self {
        Self {
            mode: ProxyIdentityMode::Uid,
            container: DEFAULT_PROXY_CONTAINER.into(),
        }
    }
}

/// Proxy identity by container, as recorded for a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ContainerIdentity {
    /// The proxy container's name in the pod's spec.
    pub container: String,
    #[serde(default)]
    pub proxy: ProxyContainer,
}

/// What is known of the pod's proxy container.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", tag = "state")]
pub enum ProxyContainer {
    /// Not seen yet: connections the proxy's ids would exempt are refused until it is.
    #[default]
    Unknown,
    /// Its cgroup, and the runtime's container id where the runtime named it.
    Known {
        cgroup: PathBuf,
        cgroup_id: u64,
        #[serde(default, skip_serializing_if = "Option::is_none")]
        container_id: Option<String>,
    },
    /// The pod has no container of that name: nothing is exempt by owner.
    None,
}

impl ProxyContainer {
    /// One line for status.
    #[must_use]
    pub fn describe(&self) -> String {
        match self {
            Self::Unknown => "not known yet (proxy-uid connections refused until it is)".into(),
            Self::Known {
                cgroup,
                container_id,
                ..
            } => match container_id {
                Some(id) => format!("{} (container {})", cgroup.display(), short_id(id)),
                None => cgroup.display().to_string(),
            },
            Self::None => {
                "none: the pod has no proxy container, every container is captured".into()
            }
        }
    }
}

fn short_id(id: &str) -> &str {
    &id[..id.len().min(12)]
}

/// The pod's mode: its annotation, else the node's default.
pub fn mode_of(
    annotation: Option<&str>,
    defaults: &IdentityDefaults,
) -> Result<ProxyIdentityMode, ConfigError> {
    match annotation.map(str::trim) {
        None => Ok(defaults.mode),
        Some("uid") => Ok(ProxyIdentityMode::Uid),
        Some("container") => Ok(ProxyIdentityMode::Container),
        Some(_) => Err(bad(
            ANN_PROXY_IDENTITY,
            annotation.unwrap_or_default(),
            "must be container or uid",
        )),
    }
}

/// The pod's identity by container, if its mode says so. The injector's status annotation, when
/// present, says whether the proxy container exists; without it the container may still come.
pub fn container_identity(
    mode: ProxyIdentityMode,
    sidecar_status: Option<&str>,
    defaults: &IdentityDefaults,
) -> Result<Option<ContainerIdentity>, ConfigError> {
    if mode == ProxyIdentityMode::Uid {
        return Ok(None);
    }
    // A status that is not the injector's JSON says nothing of the containers: the proxy may
    // still come (the CNI selection reports the annotation).
    let names_proxy = sidecar_status
        .map(|v| serde_json::from_str::<SidecarStatus>(v).map(|s| s.names(&defaults.container)));
    let proxy = match names_proxy {
        Some(Ok(false)) => ProxyContainer::None,
        None | Some(Ok(true) | Err(_)) => ProxyContainer::Unknown,
    };
    Ok(Some(ContainerIdentity {
        container: defaults.container.clone(),
        proxy,
    }))
}

/// The injector's status annotation, the fields capture reads.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SidecarStatus {
    #[serde(default)]
    containers: Option<Vec<String>>,
    #[serde(default)]
    init_containers: Option<Vec<String>>,
}

impl SidecarStatus {
    fn names(&self, container: &str) -> bool {
        [&self.containers, &self.init_containers]
            .into_iter()
            .flatten()
            .flatten()
            .any(|c| c == container)
    }
}

/// The proxy container's cgroup, checked: a cgroup v2 directory strictly below the pod's.
pub fn known_cgroup(
    pod_cgroup: &Path,
    proxy_cgroup: &Path,
    container_id: Option<String>,
) -> Result<ProxyContainer, ConfigError> {
    let pod = canonical(pod_cgroup)?;
    let proxy = canonical(proxy_cgroup)?;
    if proxy == pod || !proxy.starts_with(&pod) {
        return Err(ConfigError::Pod(format!(
            "proxy cgroup {}: not below the pod's cgroup {}; pass the proxy container's own cgroup directory",
            proxy_cgroup.display(),
            pod_cgroup.display()
        )));
    }
    crate::cgroup::open_cgroup2(&proxy).map_err(|e| ConfigError::Pod(e.to_string()))?;
    let cgroup_id = std::fs::metadata(&proxy)
        .map_err(|e| ConfigError::Pod(format!("proxy cgroup {}: {e}", proxy.display())))?
        .ino();
    Ok(ProxyContainer::Known {
        cgroup: proxy,
        cgroup_id,
        container_id,
    })
}

fn canonical(path: &Path) -> Result<PathBuf, ConfigError> {
    path.canonicalize()
        .map_err(|e| ConfigError::Pod(format!("cgroup {}: {e}", path.display())))
}

/// Why the iptables backend refuses proxy identity by container.
pub const IPTABLES_CANNOT: &str = "proxy identity by container (capture.dev/proxy-identity: container, or --proxy-identity container) needs the ebpf backend: iptables' owner match sees the socket's uid and gid, not the container; capture the pod with --mode ebpf, or use --proxy-identity uid";

/// Why a pod under proxy identity by container is not captured by iptables instead.
#[must_use]
pub fn no_fallback(ebpf_gap: &str) -> String {
    format!(
        "the ebpf backend cannot capture this pod ({ebpf_gap}), and falling back to iptables would drop its proxy identity by container to the uid rules; remove the pod's need for iptables or use --proxy-identity uid"
    )
}

/// Writes the proxy container's cgroup into the config, where the caller named it.
///
/// # Errors
/// A cgroup without proxy identity by container, or one that is not the pod's.
pub fn resolve_proxy_cgroup(
    config: &mut CaptureConfig,
    pod_cgroup: &Path,
    proxy_cgroup: Option<&Path>,
) -> Result<(), ConfigError> {
    let Some(path) = proxy_cgroup else {
        return Ok(());
    };
    let Some(identity) = config.proxy_identity.as_mut() else {
        return Err(ConfigError::Pod(format!(
            "--proxy-cgroup {} names the proxy container, but the pod's proxy identity is by uid; add --proxy-identity container (or the annotation {}: container)",
            path.display(),
            ANN_PROXY_IDENTITY
        )));
    };
    identity.proxy = known_cgroup(pod_cgroup, path, None)?;
    Ok(())
}

/// A repeated attach that names no proxy cgroup asks for what the record holds, where the proxy
/// container has become known since.
#[must_use]
pub fn as_learned(
    requested: Option<ContainerIdentity>,
    existing: Option<&ContainerIdentity>,
) -> Option<ContainerIdentity> {
    match (requested, existing) {
        (Some(r), Some(e)) if r.proxy == ProxyContainer::Unknown && r.container == e.container => {
            Some(e.clone())
        }
        (requested, _) => requested,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_annotation_wins_over_the_node_default_and_names_bad_values() {
        let node = IdentityDefaults {
            mode: ProxyIdentityMode::Container,
            ..IdentityDefaults::default()
        };
        assert_eq!(mode_of(None, &node), Ok(ProxyIdentityMode::Container));
        assert_eq!(mode_of(Some(" uid"), &node), Ok(ProxyIdentityMode::Uid));
        let err = mode_of(Some("pod"), &node).unwrap_err().to_string();
        assert!(
            err.contains(ANN_PROXY_IDENTITY) && err.contains("\"pod\""),
            "{err}"
        );
    }

    #[test]
    fn the_injector_status_says_whether_a_proxy_container_exists() {
        let d = IdentityDefaults::default();
        let with = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"]}"#;
        let native = r#"{"initContainers":["istio-proxy"],"containers":null}"#;
        let without = r#"{"initContainers":["istio-init"],"containers":["other"]}"#;
        let known = |s| {
            container_identity(ProxyIdentityMode::Container, s, &d)
                .unwrap()
                .unwrap()
                .proxy
        };
        assert_eq!(known(None), ProxyContainer::Unknown);
        assert_eq!(known(Some(with)), ProxyContainer::Unknown);
        assert_eq!(known(Some(native)), ProxyContainer::Unknown);
        assert_eq!(known(Some(without)), ProxyContainer::None);
        assert_eq!(
            container_identity(ProxyIdentityMode::Uid, Some(with), &d).unwrap(),
            None
        );
        assert_eq!(
            known(Some("{")),
            ProxyContainer::Unknown,
            "unreadable says nothing"
        );
    }
}
