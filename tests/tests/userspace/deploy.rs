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
            if let Err(e) = capture_user::cli::Cli::try_parse_from(&c.argv) {
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
        "mountPropagation: Bidirectional",
        "path: /sys/fs/cgroup",
        "path: /var/run/netns",
        "path: /run/capture",
        "hostPID: true",
        "privileged: true",
        "path: /readyz",
        "path: /healthz",
        "fieldPath: status.hostIP",
        "--metrics=$(NODE_IP):15301",
        "prometheus.io/port: \"15301\"",
        "containerPort: 15301",
        "--mesh-config=/etc/istio/config/mesh",
        "name: istio\n",
        "--annotation-policy=/etc/capture/policy/policy.yaml",
        "name: capture-annotation-policy",
    ] {
        assert!(yaml.contains(needle), "capture.yaml lacks {needle:?}");
    }
}
