//! What a binary says it is built from: `capture version` and the agent's `capture_build_info`
//! name the same build, and the commit the workspace is at.

use std::process::Command;

use capture_tests::{cni::Node, topology::capture_bin};
use serde_json::Value;

#[test]
fn the_version_command_and_the_agents_build_info_name_the_same_build() {
    let out = Command::new(capture_bin())
        .args(["version", "--json"])
        .output()
        .expect("capture version");
    assert!(out.status.success(), "{out:?}");
    let info: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    let field = |key: &str| {
        info[key]
            .as_str()
            .unwrap_or_else(|| panic!("no {key} in {info}"))
            .to_string()
    };
    let (version, commit) = (field("version"), field("commit"));
    // The workspace's own commit, where git can say it (not in a source tree without .git).
    let head = Command::new("git")
        .args(["rev-parse", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
    if let Some(head) = head {
        assert_eq!(commit, head, "{info}");
    }
    let release = env!("CARGO_PKG_VERSION");
    assert!(
        version == release || version == format!("{release}-dev.{}", &commit[..12]),
        "{info}"
    );

    let node = Node::new();
    let agent = node.start_agent("ebpf");
    let metrics = agent.checked_metrics();
    let series = format!(
        "capture_build_info{{version=\"{version}\",commit=\"{commit}\",programs=\"{}\",target=\"{}\",rustc=\"{}\"}} 1",
        field("programs"),
        field("target"),
        field("rustc"),
    );
    assert!(metrics.contains(&series), "{series} in\n{metrics}");
}
