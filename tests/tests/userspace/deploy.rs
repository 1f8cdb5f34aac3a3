//! deploy/: the manifests are valid Kubernetes objects, and every command line in them is one the
//! `capture` binary accepts.

use std::{path::PathBuf, process::Command};

use clap::Parser as _;

/// The Kubernetes objects of deploy/: every YAML file but Prometheus's own rules file and its
/// unit test, which are no objects (alerts.rs checks them; the `PrometheusRule` is an object).
fn manifests() -> Vec<PathBuf> {
    use capture_tests::promtool::{RULES_FILE, RULES_TEST_FILE};
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .filter(|p| !p.ends_with(RULES_FILE) && !p.ends_with(RULES_TEST_FILE))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no manifests in {}", dir.display());
    files
}

#[test]
fn manifests_validate_against_the_kubernetes_schemas() {
    for file in manifests() {
        let out = Command::new("python3")
            .args(["-m", "kubernetes_validate", "--strict"])
            .arg(&file)
            .output()
            .expect("python3 (cargo xtask setup installs kubernetes-validate)");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(out.status.success(), "{}: {text}", file.display());
        assert!(!text.contains("ERROR"), "{}: {text}", file.display());
    }
}

#[test]
fn manifest_commands_parse() {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml");
    // Kubernetes substitutes `$(NODE_IP)` from the downward API, with a node's address of either
    // family (an IPv6 one without brackets).
    for node_ip in ["10.0.0.5", "fd00::5"] {
        let pod = capture_tests::daemonset::node_agent(
            &manifest,
            node_ip,
            std::path::Path::new("/configmaps"),
        );
        let containers: Vec<_> = pod.init_containers.iter().chain(&pod.containers).collect();
        assert_eq!(
            containers.len(),
            2,
            "expected the install-cni and agent command lines"
        );
        for c in containers {
            assert!(c.argv[0].ends_with("/capture"), "{}: {:?}", c.name, c.argv);
            if let Err(e) = capture::cli::Cli::try_parse_from(&c.argv) {
                panic!(
                    "{}: {:?} is not a valid capture command line: {e}",
                    c.name, c.argv
                );
            }
        }
    }
}

#[test]
fn the_daemonset_mounts_what_the_agent_needs() {
    let yaml = std::fs::read_to_string(
        manifests()
            .into_iter()
            .find(|f| f.ends_with("capture.yaml"))
            .unwrap(),
    )
    .unwrap();
    for needle in [
        "path: /opt/cni/bin",
        "path: /etc/cni/net.d",
        "path: /sys/fs/bpf",
        "mountPropagation: HostToContainer",
        "path: /sys/fs/cgroup",
        "path: /var/run/netns",
        "path: /run/capture",
        "path: /proc\n",
        "mountPath: /host/proc",
        "name: CAPTURE_HOST_PROC",
        "readOnlyRootFilesystem: true",
        "type: RuntimeDefault",
        "path: /readyz",
        "path: /healthz",
        "fieldPath: status.hostIP",
        "--metrics=$(NODE_IP):15301",
        "prometheus.io/port: \"15301\"",
        "containerPort: 15301",
        "--mesh-config=/etc/istio/config\n",
        "path: istio\n",
        "name: istio\n",
        "--annotation-policy=/etc/capture/policy/policy.yaml",
        "name: capture-annotation-policy",
    ] {
        assert!(yaml.contains(needle), "capture.yaml lacks {needle:?}");
    }
    // Least privilege (the pod's context is checked field by field in capture_tests::daemonset):
    // no privileged container, no node PID namespace, and no Bidirectional mount, which
    // Kubernetes allows only a privileged container.
    for needle in ["privileged: true", "hostPID: true", "Bidirectional"] {
        assert!(!yaml.contains(needle), "capture.yaml has {needle:?}");
    }
}

/// Istio's untaint controller (istio/istio `pilot/pkg/controllers/untaint/nodeuntainter.go`)
/// removes `cni.istio.io/not-ready` from a node once a pod of its CNI namespace (`taint.namespace`,
/// by default istiod's, istio-system) whose labels include `k8s-app: istio-cni-node` has its Ready
/// condition true there. The agent's pod is that pod: in istio-system, labelled so, tolerating
/// the taint, and Ready by a probe of `/readyz`, which says ready only once the agent serves ADD
/// and capture-cni is chained (`node/live_node.rs`, `userspace/cni_fight.rs`). Its DaemonSet's
/// selector must not match istio-cni's own pods (labelled `k8s-app: istio-cni-node`,
/// `app.kubernetes.io/name: istio-cni` by Istio's chart).
#[test]
fn the_node_agent_counts_as_istio_cni_for_istios_untaint_controller() {
    let manifest = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy/capture.yaml");
    let text = std::fs::read_to_string(&manifest).unwrap();
    let docs: Vec<serde_json::Value> = serde_yaml_ng::Deserializer::from_str(&text)
        .map(|d| serde::Deserialize::deserialize(d).unwrap())
        .collect();
    let ds = docs
        .iter()
        .find(|d| d["kind"] == "DaemonSet")
        .expect("the DaemonSet");
    // nodeuntainter.go: `ns := cniNs; if ns == "" { ns = sysNs }`, `istioCniLabels`.
    assert_eq!(ds["metadata"]["namespace"], "istio-system");
    let labels = &ds["spec"]["template"]["metadata"]["labels"];
    assert_eq!(labels["k8s-app"], "istio-cni-node", "{labels}");

    let selector = ds["spec"]["selector"]["matchLabels"]
        .as_object()
        .expect("matchLabels");
    let istio_cni_pod = serde_json::json!({
        "k8s-app": "istio-cni-node",
        "app.kubernetes.io/name": "istio-cni",
    });
    assert!(
        selector.iter().any(|(k, v)| istio_cni_pod[k] != *v),
        "the selector {selector:?} would adopt istio-cni's pods"
    );
    for (k, v) in selector {
        assert_eq!(&labels[k], v, "the template carries the selector's labels");
    }

    let spec = &ds["spec"]["template"]["spec"];
    let tolerates_not_ready = spec["tolerations"]
        .as_array()
        .into_iter()
        .flatten()
        .any(|t| {
            let key = t["key"].as_str();
            t["operator"] == "Exists"
                && (key.is_none() || key == Some("cni.istio.io/not-ready"))
                && t["effect"].as_str().is_none_or(|e| e == "NoSchedule")
        });
    assert!(tolerates_not_ready, "{}", spec["tolerations"]);

    let agent = spec["containers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "agent")
        .expect("the agent container");
    let probe = &agent["readinessProbe"]["httpGet"];
    assert_eq!(probe["path"], "/readyz", "{agent}");
    let http = agent["command"]
        .as_array()
        .unwrap()
        .iter()
        .find_map(|a| a.as_str()?.strip_prefix("--http="))
        .expect("--http");
    assert_eq!(
        http,
        format!("{}:{}", probe["host"].as_str().unwrap(), probe["port"]),
        "the probe asks the agent's own /readyz"
    );
    assert!(
        agent["command"]
            .as_array()
            .unwrap()
            .iter()
            .any(|a| a == "--watch-cni-config"),
        "readiness follows capture-cni's chain only with --watch-cni-config"
    );
}
