//! Istio's mesh configuration (the `istio` ConfigMap's `mesh` key: a MeshConfig in YAML), as far
//! as it decides capture: the sidecar defaults of `defaultConfig` (a ProxyConfig).
//!
//! With its CNI on, Istio's injector writes a pod's interception mode and include/exclude lists
//! into the pod's annotations (`injection-template.yaml` in
//! `manifests/charts/istio-control/istio-discovery/files/`), taking them from
//! `defaultConfig.interceptionMode` and the injector's values (`global.proxy.includeIPRanges`,
//! ...), which are not in the mesh configuration. `defaultConfig.proxyMetadata` goes into the
//! proxy's environment only, where istio-cni reads `ISTIO_META_DNS_CAPTURE` and `INVALID_DROP`
//! (`cni/pkg/plugin/sidecar_redirect.go`): those reach capture from this file alone. A pod's
//! `proxy.istio.io/config` is merged over `defaultConfig` by the injector
//! (`mesh.MergeProxyConfig` in `pkg/config/mesh/mesh.go`: its fields replace the mesh's, and
//! proxyMetadata is merged key by key).

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};

use super::Revision;

/// The proxy metadata keys capture reads (the proxy's environment).
pub const DNS_CAPTURE: &str = "ISTIO_META_DNS_CAPTURE";
pub const INVALID_DROP: &str = "INVALID_DROP";

/// What capture takes from a mesh configuration.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshConfig {
    /// `defaultConfig.interceptionMode`: `REDIRECT`, `TPROXY` or `NONE`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interception_mode: Option<String>,
    /// The `defaultConfig.proxyMetadata` keys capture reads, as Istio reads them: a value Go's
    /// `strconv.ParseBool` refuses is false (with a warning), as istio-cni and the proxy read it.
    #[serde(default)]
    pub proxy_metadata: BTreeMap<String, bool>,
    /// What was read leniently, as Istio reads it, for the operator to fix.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub warnings: Vec<String>,
}

/// Go's `strconv.ParseBool`, with which Istio reads boolean settings.
#[must_use]
pub fn go_parse_bool(value: &str) -> Option<bool> {
    match value {
        "1" | "t" | "T" | "TRUE" | "true" | "True" => Some(true),
        "0" | "f" | "F" | "FALSE" | "false" | "False" => Some(false),
        _ => None,
    }
}

impl MeshConfig {
    /// Reads a mesh configuration. Fields capture does not use are ignored, as they are many and
    /// change with each Istio release; the ones it uses must have Istio's types, or the whole
    /// file is refused, as istiod refuses it.
    pub fn parse(text: &str) -> Result<Self, String> {
        let doc: serde_yaml_ng::Value =
            serde_yaml_ng::from_str(text).map_err(|e| format!("not YAML: {e}"))?;
        let root = match &doc {
            serde_yaml_ng::Value::Null => return Ok(Self::default()),
            serde_yaml_ng::Value::Mapping(m) => m,
            other => return Err(format!("not a MeshConfig mapping but {}", kind(other))),
        };
        // The ConfigMap itself (`kubectl get configmap istio -o yaml`) rather than its key.
        if root.get("kind").and_then(serde_yaml_ng::Value::as_str) == Some("ConfigMap") {
            return match root.get("data").and_then(|d| d.get("mesh")) {
                Some(serde_yaml_ng::Value::String(mesh)) => Self::parse(mesh),
                _ => Err("a ConfigMap without a data.mesh key".into()),
            };
        }
        let mut mesh = Self::default();
        // istio-init redirects to these ports; istio-cni redirects to 15001 and 15006 whatever
        // they say (`sidecar_redirect.go`), and so does capture.
        for (key, istio_cni_port) in [
            ("proxyListenPort", 15001),
            ("proxyInboundListenPort", 15006),
        ] {
            if let Some(port) = root.get(key).and_then(serde_yaml_ng::Value::as_u64) {
                if port != istio_cni_port {
                    mesh.warnings.push(format!(
                        "{key}={port} is not used: istio-cni and capture redirect to {istio_cni_port}"
                    ));
                }
            }
        }
        let default_config = match root.get("defaultConfig") {
            None | Some(serde_yaml_ng::Value::Null) => return Ok(mesh),
            Some(serde_yaml_ng::Value::Mapping(m)) => m,
            Some(other) => return Err(format!("defaultConfig is {}, not a mapping", kind(other))),
        };
        if let Some(mode) = default_config.get("interceptionMode") {
            let mode = mode.as_str().ok_or_else(|| {
                format!(
                    "defaultConfig.interceptionMode is {}, not REDIRECT, TPROXY or NONE",
                    kind(mode)
                )
            })?;
            if !matches!(mode, "REDIRECT" | "TPROXY" | "NONE") {
                return Err(format!(
                    "defaultConfig.interceptionMode={mode:?} is not REDIRECT, TPROXY or NONE"
                ));
            }
            mesh.interception_mode = Some(mode.to_string());
        }
        match default_config.get("proxyMetadata") {
            None | Some(serde_yaml_ng::Value::Null) => {}
            Some(serde_yaml_ng::Value::Mapping(metadata)) => {
                for key in [DNS_CAPTURE, INVALID_DROP] {
                    let Some(value) = metadata.get(key) else {
                        continue;
                    };
                    // A map<string, string> in Istio's proto: another YAML type is refused.
                    let value = value.as_str().ok_or_else(|| {
                        format!(
                            "defaultConfig.proxyMetadata.{key} is {}; proxyMetadata values are strings (quote it: \"true\")",
                            kind(value)
                        )
                    })?;
                    let on = go_parse_bool(value).unwrap_or_else(|| {
                        mesh.warnings.push(format!(
                            "defaultConfig.proxyMetadata.{key}={value:?} is not a Go boolean: read as false, as Istio reads it"
                        ));
                        false
                    });
                    mesh.proxy_metadata.insert(key.to_string(), on);
                }
            }
            Some(other) => {
                return Err(format!(
                    "defaultConfig.proxyMetadata is {}, not a mapping",
                    kind(other)
                ))
            }
        }
        Ok(mesh)
    }

    /// A proxy metadata key's value, if the mesh sets it.
    #[must_use]
    pub fn metadata(&self, key: &str) -> Option<bool> {
        self.proxy_metadata.get(key).copied()
    }
}

fn kind(value: &serde_yaml_ng::Value) -> &'static str {
    match value {
        serde_yaml_ng::Value::Null => "null",
        serde_yaml_ng::Value::Bool(_) => "a boolean",
        serde_yaml_ng::Value::Number(_) => "a number",
        serde_yaml_ng::Value::String(_) => "a string",
        serde_yaml_ng::Value::Sequence(_) => "a list",
        serde_yaml_ng::Value::Mapping(_) => "a mapping",
        serde_yaml_ng::Value::Tagged(_) => "a tagged value",
    }
}

/// Reads and parses a mesh configuration file; the error names the file.
pub fn read(path: &Path) -> Result<MeshConfig, String> {
    let text = std::fs::read_to_string(path).map_err(|e| {
        format!(
            "mesh configuration {}: {e} (mount the istio ConfigMap's mesh key there, or drop --mesh-config)",
            path.display()
        )
    })?;
    MeshConfig::parse(&text).map_err(|e| format!("mesh configuration {}: {e}", path.display()))
}

/// How `--mesh-config` names the mesh configurations: one file for every pod, or a directory of
/// one file per control-plane revision, each named as its ConfigMap (`istio`, `istio-<rev>`;
/// the `mesh` key of each, or the whole ConfigMap), or of one directory per ConfigMap mounted
/// whole (`istio-<rev>/mesh`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MeshLayout {
    /// One file, whatever the pod's revision (the layout before revisions were told apart).
    File(PathBuf),
    Dir(PathBuf),
}

/// A directory's file for the default revision besides `istio`: the `istio` ConfigMap mounted
/// whole names its key `mesh`.
pub const MESH_KEY: &str = "mesh";

impl MeshLayout {
    #[must_use]
    pub fn of(path: &Path) -> Self {
        if path.is_dir() {
            Self::Dir(path.to_path_buf())
        } else {
            Self::File(path.to_path_buf())
        }
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        match self {
            Self::File(p) | Self::Dir(p) => p,
        }
    }

    /// The file that holds `revision`'s mesh configuration, and the name `capture status` gives
    /// it (its ConfigMap's); the error says which ConfigMap is missing and where.
    ///
    /// # Errors
    /// A directory without the revision's file.
    pub fn file_for(&self, revision: &Revision) -> Result<(PathBuf, String), String> {
        match self {
            Self::File(path) => Ok((path.clone(), path.display().to_string())),
            Self::Dir(dir) => {
                let config_map = revision.config_map();
                // A file named as the ConfigMap (a projected volume), or the ConfigMap mounted
                // whole as a directory of its keys.
                let mut candidates =
                    vec![dir.join(&config_map), dir.join(&config_map).join(MESH_KEY)];
                if revision.is_default() {
                    candidates.push(dir.join(MESH_KEY));
                }
                candidates
                    .into_iter()
                    .find(|p| p.is_file())
                    .map(|p| (p, config_map.clone()))
                    .ok_or_else(|| missing_revision(revision, dir))
            }
        }
    }

    /// Every revision's file of a directory (the one file, as the default revision's).
    #[must_use]
    pub fn files(&self) -> Vec<(Revision, PathBuf)> {
        match self {
            Self::File(path) => vec![(Revision::default_revision(), path.clone())],
            Self::Dir(dir) => {
                let mut files: Vec<(Revision, PathBuf)> = std::fs::read_dir(dir)
                    .into_iter()
                    .flatten()
                    .flatten()
                    .filter_map(|e| {
                        let name = e.file_name().to_string_lossy().into_owned();
                        let revision = Revision::of_config_map(&name)?;
                        let path = e.path();
                        let file = if path.is_dir() {
                            path.join(MESH_KEY)
                        } else {
                            path
                        };
                        file.is_file().then_some((revision, file))
                    })
                    .collect();
                if !files.iter().any(|(r, _)| r.is_default()) && dir.join(MESH_KEY).is_file() {
                    files.push((Revision::default_revision(), dir.join(MESH_KEY)));
                }
                files.sort();
                files
            }
        }
    }
}

/// Why a pod of `revision` cannot be set up: its ConfigMap is not mounted in `dir`.
#[must_use]
pub fn missing_revision(revision: &Revision, dir: &Path) -> String {
    format!(
        "no mesh configuration for Istio revision {revision}: the ConfigMap {} (istio-system) is not in {}; add it to the istio-mesh volume's sources (docs/using/mesh-configuration.md)",
        revision.config_map(),
        dir.display()
    )
}

/// Reads the mesh configuration of `revision` under `--mesh-config` (the CLI's single read; the
/// agent keeps each file's last good content, `agent::mesh_watch`); the error names the file or
/// the missing ConfigMap.
///
/// # Errors
/// The file is missing, unreadable or refused.
pub fn read_for(layout: &MeshLayout, revision: &Revision) -> Result<(MeshConfig, String), String> {
    let (path, name) = layout.file_for(revision)?;
    read(&path).map(|mesh| (mesh, name))
}

/// The agent's mesh configuration as `capture status` shows it (`<state_dir>/mesh-config.json`,
/// and one per revision in `mesh-configs.json`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct MeshConfigReport {
    /// The file the agent reads (`--mesh-config`, or its revision's file in the directory).
    pub path: PathBuf,
    /// The revision it is for (`default`), where `--mesh-config` is a directory.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub revision: Option<String>,
    /// What new pods are set up with, and when it was read.
    pub in_use: Option<MeshConfig>,
    pub loaded_at_unix: Option<u64>,
    /// Why the file's present content is not in use (the last good one is), and since when.
    pub problem: Option<String>,
    pub problem_since_unix: Option<u64>,
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The `mesh` key as Istio's istiod chart renders it, with DNS capture on.
    const ISTIOD_CHART_MESH: &str = r#"
defaultConfig:
  discoveryAddress: istiod.istio-system.svc:15012
  proxyMetadata:
    ISTIO_META_DNS_CAPTURE: "true"
    ISTIO_META_DNS_AUTO_ALLOCATE: "true"
  tracing:
    zipkin:
      address: zipkin.istio-system:9411
defaultProviders:
  metrics:
  - prometheus
enablePrometheusMerge: true
rootNamespace: istio-system
trustDomain: cluster.local
"#;

    #[test]
    fn the_settings_capture_uses_are_read_and_the_rest_ignored() {
        let mesh = MeshConfig::parse(ISTIOD_CHART_MESH).unwrap();
        assert_eq!(mesh.metadata(DNS_CAPTURE), Some(true));
        assert_eq!(mesh.metadata(INVALID_DROP), None);
        assert_eq!(mesh.interception_mode, None);
        assert!(mesh.warnings.is_empty());
        let tproxy =
            MeshConfig::parse("defaultConfig:\n  interceptionMode: TPROXY\n  proxyMetadata:\n    INVALID_DROP: \"1\"\n")
                .unwrap();
        assert_eq!(tproxy.interception_mode.as_deref(), Some("TPROXY"));
        assert_eq!(tproxy.metadata(INVALID_DROP), Some(true));
        let config_map = format!(
            "apiVersion: v1\nkind: ConfigMap\nmetadata:\n  name: istio\n  namespace: istio-system\ndata:\n  mesh: |-\n{}",
            ISTIOD_CHART_MESH.lines().map(|l| format!("    {l}\n")).collect::<String>()
        );
        assert_eq!(MeshConfig::parse(&config_map).unwrap(), mesh);
        assert!(
            MeshConfig::parse("kind: ConfigMap\ndata:\n  meshNetworks: x\n")
                .unwrap_err()
                .contains("data.mesh")
        );
        for empty in ["", "{}", "defaultConfig:", "trustDomain: cluster.local"] {
            assert_eq!(
                MeshConfig::parse(empty).unwrap(),
                MeshConfig::default(),
                "{empty:?}"
            );
        }
    }

    #[test]
    fn values_istio_reads_leniently_are_read_so_and_warned_about() {
        let mesh = MeshConfig::parse(
            "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"yes\"\n",
        )
        .unwrap();
        assert_eq!(mesh.metadata(DNS_CAPTURE), Some(false));
        assert!(mesh.warnings[0].contains("\"yes\""), "{:?}", mesh.warnings);
        let ports =
            MeshConfig::parse("proxyListenPort: 15001\nproxyInboundListenPort: 16006\n").unwrap();
        assert_eq!(ports.warnings.len(), 1, "{:?}", ports.warnings);
        assert!(ports.warnings[0].starts_with("proxyInboundListenPort=16006"));
    }

    #[test]
    fn files_istiod_refuses_are_refused_with_the_field() {
        for (text, names) in [
            ("defaultConfig: [", "not YAML"),
            ("- a\n- b\n", "not a MeshConfig mapping but a list"),
            ("defaultConfig: 3\n", "defaultConfig is a number"),
            (
                "defaultConfig:\n  interceptionMode: redirect\n",
                "interceptionMode=\"redirect\"",
            ),
            (
                "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: true\n",
                "ISTIO_META_DNS_CAPTURE is a boolean",
            ),
            (
                "defaultConfig:\n  proxyMetadata: [a]\n",
                "proxyMetadata is a list",
            ),
        ] {
            let e = MeshConfig::parse(text).unwrap_err();
            assert!(e.contains(names), "{text:?}: {e}");
        }
    }
}
