//! deploy/: the manifests are valid Kubernetes objects, and every command line in them is one the
//! `capture` binary accepts.

use std::{path::PathBuf, process::Command};

use clap::Parser as _;

fn manifests() -> Vec<PathBuf> {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../deploy");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
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

/// The `command:` lists of a manifest (block style, one `- item` per line).
fn commands(yaml: &str) -> Vec<Vec<String>> {
    let mut out = Vec::new();
    let mut lines = yaml.lines().peekable();
    while let Some(line) = lines.next() {
        if line.trim() != "command:" {
            continue;
        }
        let mut cmd = Vec::new();
        while let Some(next) = lines.peek() {
            let Some(item) = next.trim().strip_prefix("- ") else {
                break;
            };
            cmd.push(item.trim_matches('"').to_string());
            lines.next();
        }
        out.push(cmd);
    }
    out
}

#[test]
fn manifest_commands_parse() {
    let mut seen = 0;
    for file in manifests() {
        for cmd in commands(&std::fs::read_to_string(&file).unwrap()) {
            assert!(cmd[0].ends_with("/capture"), "{}: {cmd:?}", file.display());
            // Kubernetes substitutes `$(NODE_IP)` from the downward API, with a node's address of
            // either family (an IPv6 one without brackets).
            for node_ip in ["10.0.0.5", "fd00::5"] {
                let cmd: Vec<String> = cmd
                    .iter()
                    .map(|a| a.replace("$(NODE_IP)", node_ip))
                    .collect();
                if let Err(e) = capture_user::cli::Cli::try_parse_from(&cmd) {
                    panic!(
                        "{}: {cmd:?} is not a valid capture command line: {e}",
                        file.display()
                    );
                }
            }
            seen += 1;
        }
    }
    assert!(
        seen >= 2,
        "expected the install-cni and agent command lines"
    );
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
    ] {
        assert!(yaml.contains(needle), "capture.yaml lacks {needle:?}");
    }
}
