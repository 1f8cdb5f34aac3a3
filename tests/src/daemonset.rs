//! deploy/capture.yaml's DaemonSet pod, read as the kubelet reads it: each container's command
//! line with `$(VAR)` expanded from its environment (the downward API's `status.hostIP` given),
//! its security context (with the pod's seccomp profile where it names none), its mounts joined
//! with the pod's hostPath, ConfigMap and emptyDir volumes, and its readiness probe. Tests that run the pod through a container runtime take every one of these from the
//! manifest rather than repeating them.

use std::{collections::BTreeMap, path::Path};

use serde_json::Value;

/// The DaemonSet's pod template, as the tests need it.
#[derive(Debug, Clone)]
pub struct NodeAgentPod {
    pub host_network: bool,
    pub host_pid: bool,
    /// The pod's `seccompProfile.type`.
    pub seccomp: Option<String>,
    /// Run to completion, in order, before `containers` start.
    pub init_containers: Vec<ContainerSpec>,
    pub containers: Vec<ContainerSpec>,
}

#[derive(Debug, Clone)]
pub struct ContainerSpec {
    pub name: String,
    pub image: String,
    /// `command` then `args`, with `$(VAR)` expanded.
    pub argv: Vec<String>,
    /// Literal values and the downward API's node address.
    pub env: Vec<(String, String)>,
    pub privileged: bool,
    pub run_as_user: Option<i64>,
    pub capabilities_add: Vec<String>,
    pub capabilities_drop: Vec<String>,
    pub allow_privilege_escalation: Option<bool>,
    pub read_only_root_filesystem: bool,
    /// `seccompProfile.type` (`RuntimeDefault`, `Unconfined`), the container's or else the
    /// pod's; None where neither names one.
    pub seccomp: Option<String>,
    /// `appArmorProfile.type`, the container's or else the pod's.
    pub apparmor: Option<String>,
    pub mounts: Vec<Mount>,
    pub readiness: Option<HttpProbe>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Mount {
    /// The volume's `hostPath.path`: where on the node.
    pub host_path: String,
    pub container_path: String,
    pub read_only: bool,
    /// `mountPropagation`: `None`, `HostToContainer` or `Bidirectional`.
    pub propagation: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HttpProbe {
    pub host: String,
    pub port: u16,
    pub path: String,
    pub period_seconds: u64,
}

/// The DaemonSet of `manifest` (the first one), with `node_ip` standing for `status.hostIP` and
/// each ConfigMap volume `NAME` projected from the directory `config_maps/NAME`, where the test
/// writes its keys as kubelet would (the manifest's own ConfigMaps' keys are written there too,
/// where the test wrote none, if `config_maps` exists), and each emptyDir volume `NAME` an empty
/// directory `config_maps/NAME.empty`, made where `config_maps` exists.
pub fn node_agent(manifest: &Path, node_ip: &str, config_maps: &Path) -> NodeAgentPod {
    let text = std::fs::read_to_string(manifest)
        .unwrap_or_else(|e| panic!("reading {}: {e}", manifest.display()));
    let docs: Vec<Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", manifest.display()))
        })
        .collect();
    // The manifest's own ConfigMaps, as kubelet projects them (a test's files win), where the
    // test made a directory for them.
    let projected = config_maps.is_dir();
    for config_map in docs
        .iter()
        .filter(|d| projected && d["kind"] == "ConfigMap")
    {
        let dir = config_maps.join(config_map["metadata"]["name"].as_str().unwrap_or_default());
        for (key, value) in config_map["data"].as_object().into_iter().flatten() {
            let file = dir.join(key);
            if !file.exists() {
                std::fs::create_dir_all(&dir).expect("the ConfigMap's directory");
                std::fs::write(&file, value.as_str().unwrap_or_default()).expect("a ConfigMap key");
            }
        }
    }
    let daemonset = docs
        .into_iter()
        .find(|doc: &Value| doc["kind"] == "DaemonSet")
        .unwrap_or_else(|| panic!("no DaemonSet in {}", manifest.display()));
    let spec = &daemonset["spec"]["template"]["spec"];
    let volumes: BTreeMap<String, String> = spec["volumes"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|v| {
            let name = v["name"].as_str()?;
            let source = match (v["configMap"]["name"].as_str(), &v["projected"]) {
                (Some(config_map), _) => config_maps.join(config_map).display().to_string(),
                (None, Value::Object(_)) => project(name, &v["projected"], config_maps),
                (None, _) if v["emptyDir"].is_object() => empty_dir(name, config_maps),
                (None, _) => v["hostPath"]["path"].as_str()?.to_string(),
            };
            Some((name.to_string(), source))
        })
        .collect();
    let containers = |key: &str| -> Vec<ContainerSpec> {
        spec[key]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| container(c, &spec["securityContext"], &volumes, node_ip))
            .collect()
    };
    NodeAgentPod {
        host_network: spec["hostNetwork"] == true,
        host_pid: spec["hostPID"] == true,
        seccomp: spec["securityContext"]["seccompProfile"]["type"]
            .as_str()
            .map(str::to_string),
        init_containers: containers("initContainers"),
        containers: containers("containers"),
    }
}

/// An emptyDir volume: a directory of the pod's own, empty when the pod starts.
fn empty_dir(volume: &str, config_maps: &Path) -> String {
    let dir = config_maps.join(format!("{volume}.empty"));
    if config_maps.is_dir() {
        std::fs::create_dir_all(&dir).expect("the emptyDir volume's directory");
    }
    dir.display().to_string()
}

/// A projected volume as kubelet makes it: each ConfigMap source's items (or every key) copied
/// from `config_maps/NAME` under their paths, optional sources that are absent left out; the
/// directory made. Where `config_maps` is not a directory (a caller that reads the command
/// lines alone), nothing is made: its path is only named.
fn project(volume: &str, projected: &Value, config_maps: &Path) -> String {
    let dir = config_maps.join(format!("{volume}.projected"));
    if !config_maps.is_dir() {
        return dir.display().to_string();
    }
    std::fs::create_dir_all(&dir).expect("the projected volume's directory");
    for source in projected["sources"].as_array().into_iter().flatten() {
        let Some(config_map) = source["configMap"]["name"].as_str() else {
            continue;
        };
        let from = config_maps.join(config_map);
        let items: Vec<(String, String)> = match source["configMap"]["items"].as_array() {
            Some(items) => items
                .iter()
                .filter_map(|i| Some((i["key"].as_str()?.into(), i["path"].as_str()?.into())))
                .collect(),
            None => std::fs::read_dir(&from)
                .into_iter()
                .flatten()
                .flatten()
                .map(|e| {
                    let key = e.file_name().to_string_lossy().into_owned();
                    (key.clone(), key)
                })
                .collect(),
        };
        for (key, path) in items {
            if let Ok(data) = std::fs::read(from.join(&key)) {
                std::fs::write(dir.join(path), data).expect("a projected key");
            }
        }
    }
    dir.display().to_string()
}

fn strings(v: &Value) -> Vec<String> {
    v.as_array()
        .into_iter()
        .flatten()
        .filter_map(|s| s.as_str().map(str::to_string))
        .collect()
}

fn container(
    c: &Value,
    pod_sc: &Value,
    volumes: &BTreeMap<String, String>,
    node_ip: &str,
) -> ContainerSpec {
    let name = c["name"].as_str().unwrap_or_default().to_string();
    let env: Vec<(String, String)> = c["env"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|e| {
            let key = e["name"].as_str().unwrap_or_default().to_string();
            let value = match (&e["value"], &e["valueFrom"]["fieldRef"]["fieldPath"]) {
                (Value::String(v), _) => v.clone(),
                (_, Value::String(field)) if field == "status.hostIP" => node_ip.to_string(),
                (_, other) => panic!("{name}: env {key} from {other} is not one the tests give"),
            };
            (key, value)
        })
        .collect();
    let argv = strings(&c["command"])
        .into_iter()
        .chain(strings(&c["args"]))
        .map(|a| expand(&a, &env))
        .collect();
    let mounts = c["volumeMounts"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|m| {
            let volume = m["name"].as_str().unwrap_or_default();
            Mount {
                host_path: volumes
                    .get(volume)
                    .unwrap_or_else(|| {
                        panic!("{name}: volume {volume} is not a hostPath or ConfigMap")
                    })
                    .clone(),
                container_path: m["mountPath"].as_str().unwrap_or_default().to_string(),
                read_only: m["readOnly"] == true,
                propagation: m["mountPropagation"].as_str().unwrap_or("None").to_string(),
            }
        })
        .collect();
    let sc = &c["securityContext"];
    // A container's profile, else the pod's, as the kubelet picks them.
    let profile = |key: &str| {
        sc[key]["type"]
            .as_str()
            .or_else(|| pod_sc[key]["type"].as_str())
            .map(str::to_string)
    };
    let probe = &c["readinessProbe"];
    let readiness = probe["httpGet"].is_object().then(|| HttpProbe {
        host: probe["httpGet"]["host"]
            .as_str()
            .unwrap_or("127.0.0.1")
            .to_string(),
        port: u16::try_from(probe["httpGet"]["port"].as_u64().unwrap_or_default())
            .expect("a port number"),
        path: probe["httpGet"]["path"].as_str().unwrap_or("/").to_string(),
        // The kubelet's default period.
        period_seconds: probe["periodSeconds"].as_u64().unwrap_or(10),
    });
    ContainerSpec {
        image: built_image_for(c["image"].as_str().unwrap_or_default()),
        argv,
        env,
        privileged: sc["privileged"] == true,
        run_as_user: sc["runAsUser"].as_i64(),
        capabilities_add: strings(&sc["capabilities"]["add"]),
        capabilities_drop: strings(&sc["capabilities"]["drop"]),
        allow_privilege_escalation: sc["allowPrivilegeEscalation"].as_bool(),
        read_only_root_filesystem: sc["readOnlyRootFilesystem"] == true,
        seccomp: profile("seccompProfile"),
        apparmor: profile("appArmorProfile"),
        mounts,
        readiness,
        name,
    }
}

/// The kubelet's expansion of `$(VAR)` in a command line: a variable of the container's
/// environment is replaced, `$$` is a literal `$`, anything else stays as written.
fn expand(arg: &str, env: &[(String, String)]) -> String {
    let mut out = String::new();
    let mut rest = arg;
    while let Some(i) = rest.find('$') {
        out.push_str(&rest[..i]);
        let after = &rest[i + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some((name, tail)) = after
            .strip_prefix('(')
            .and_then(|s| s.split_once(')'))
            .filter(|(name, _)| env.iter().any(|(k, _)| k == name))
        {
            let value = env.iter().find(|(k, _)| k == name).map(|(_, v)| v);
            out.push_str(value.map_or("", String::as_str));
            rest = tail;
        } else {
            out.push('$');
            rest = after;
        }
    }
    out.push_str(rest);
    out
}

/// The image a container runs here: the built archive's for the manifest's
/// `localhost/capture:<release>` (a development build is tagged `<release>-dev.<commit>`),
/// anything else (or with no archive built) as written.
fn built_image_for(image: &str) -> String {
    match image.strip_prefix("localhost/capture:") {
        Some(_) => crate::image_name().unwrap_or_else(|| image.to_string()),
        None => image.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variables_expand_as_the_kubelet_expands_them() {
        let env = vec![("NODE_IP".to_string(), "10.88.0.1".to_string())];
        assert_eq!(
            expand("--metrics=$(NODE_IP):15301", &env),
            "--metrics=10.88.0.1:15301"
        );
        assert_eq!(expand("$$(NODE_IP)", &env), "$(NODE_IP)");
        assert_eq!(expand("$(OTHER) $", &env), "$(OTHER) $");
    }

    #[test]
    fn the_manifests_pod_reads_with_its_mounts_and_probe() {
        let manifest = Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml");
        let pod = node_agent(&manifest, "192.0.2.7", Path::new("/configmaps"));
        assert!(pod.host_network);
        assert!(
            !pod.host_pid,
            "the agent needs no hostPID: it reads /host/proc"
        );
        assert_eq!(pod.seccomp.as_deref(), Some("RuntimeDefault"));
        let [init] = &pod.init_containers[..] else {
            panic!("one init container: {pod:?}");
        };
        let [agent] = &pod.containers[..] else {
            panic!("one container: {pod:?}");
        };
        assert_eq!(init.image, agent.image);
        // Least privilege: nothing privileged, nothing gained, every capability dropped and only
        // the agent's own added back, read-only roots, the runtime's default seccomp profile.
        for c in [init, agent] {
            assert!(!c.privileged, "{c:?}");
            assert_eq!(c.allow_privilege_escalation, Some(false), "{c:?}");
            assert!(c.read_only_root_filesystem, "{c:?}");
            assert_eq!(c.capabilities_drop, ["ALL"], "{c:?}");
            assert_eq!(c.seccomp.as_deref(), Some("RuntimeDefault"), "{c:?}");
        }
        assert!(init.capabilities_add.is_empty(), "{init:?}");
        let mut added = agent.capabilities_add.clone();
        added.sort();
        assert_eq!(
            added,
            [
                "DAC_OVERRIDE",
                "NET_ADMIN",
                "NET_RAW",
                "SYS_ADMIN",
                "SYS_PTRACE"
            ]
        );
        let host_proc = agent
            .mounts
            .iter()
            .find(|m| m.container_path == "/host/proc");
        assert!(
            host_proc.is_some_and(|m| m.host_path == "/proc" && m.read_only),
            "the node's /proc, read-only: {:?}",
            agent.mounts
        );
        assert!(agent
            .env
            .contains(&("CAPTURE_HOST_PROC".to_string(), "/host/proc".to_string())));
        // Kubernetes takes Bidirectional from privileged containers only.
        assert!(agent
            .mounts
            .iter()
            .all(|m| m.propagation != "Bidirectional"));
        assert!(
            agent.argv.iter().any(|a| a.ends_with("192.0.2.7:15301")),
            "the node address expanded: {:?}",
            agent.argv
        );
        assert!(
            agent.argv.iter().all(|a| !a.contains("$(")),
            "{:?}",
            agent.argv
        );
        let probe = agent.readiness.as_ref().expect("a readiness probe");
        assert_eq!(probe.path, "/readyz");
        // Every mount is one of the pod's hostPath volumes.
        for m in init.mounts.iter().chain(&agent.mounts) {
            assert!(m.host_path.starts_with('/'), "{m:?}");
        }
    }
}
