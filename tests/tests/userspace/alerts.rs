//! deploy/'s Prometheus alerts: promtool accepts them, their unit test
//! (deploy/prometheus-rules.test.yaml) passes and shows every alert both firing and holding back,
//! the `PrometheusRule` carries the very groups of the plain rules file, and every runbook link
//! leads to a section of docs/using/runbooks.md.

use std::path::{Path, PathBuf};

use capture_tests::promtool::{
    check_rules, deploy_dir, heading_anchors, test_rules, PROMETHEUS_RULE_FILE, RULES_FILE,
    RULES_TEST_FILE,
};
use serde_json::Value;

/// Where every `runbook_url` points, up to its anchor.
const RUNBOOKS_URL: &str =
    "https://github.com/capture-mesh/capture/blob/main/docs/using/runbooks.md";

/// What issue 34 asks to be alerted on; more may come, none of these may go.
const REQUIRED_ALERTS: &[&str] = &[
    "CaptureAgentDown",
    "CaptureAgentNotReady",
    "CapturePodNotInForce",
    "CaptureKernelErrors",
    "CaptureCNIChainRewritten",
    "CaptureCNIAddFailing",
    "CaptureNodeNotOnEbpf",
    "CapturePodsFellBack",
    "CapturePodsOnOldBuild",
    "CaptureAgentBuildSkew",
    "CaptureMapFilling",
    "CapturePodsUncaptured",
];

/// The first YAML document of `file`.
fn yaml(file: &Path) -> Value {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    serde_yaml_ng::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// Every YAML document of `file`.
fn yaml_documents(file: &Path) -> Vec<Value> {
    let text =
        std::fs::read_to_string(file).unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    serde_yaml_ng::Deserializer::from_str(&text)
        .map(|doc| {
            serde::Deserialize::deserialize(doc)
                .unwrap_or_else(|e| panic!("{}: {e}", file.display()))
        })
        .collect()
}

fn rules_file() -> PathBuf {
    deploy_dir().join(RULES_FILE)
}

/// Every rule of every group.
fn rules(groups: &Value) -> Vec<&Value> {
    let groups = groups.as_array().expect("`groups` is a list");
    assert!(!groups.is_empty(), "no rule groups");
    groups
        .iter()
        .flat_map(|g| g["rules"].as_array().expect("a group's `rules` is a list"))
        .collect()
}

/// The alerting rules of the plain rules file, by name.
fn alerts() -> Vec<(String, Value)> {
    let file = yaml(&rules_file());
    rules(&file["groups"])
        .into_iter()
        .filter_map(|r| Some((r["alert"].as_str()?.to_owned(), r.clone())))
        .collect()
}

fn text<'a>(value: &'a Value, what: &str) -> &'a str {
    value
        .as_str()
        .unwrap_or_else(|| panic!("{what} is not a string: {value}"))
}

#[test]
fn promtool_accepts_every_rule() {
    let found = check_rules(&rules_file()).unwrap_or_else(|e| panic!("{e}"));
    let file = yaml(&rules_file());
    assert_eq!(
        found,
        rules(&file["groups"]).len(),
        "rules promtool counted"
    );
    let names: Vec<String> = alerts().into_iter().map(|(name, _)| name).collect();
    for required in REQUIRED_ALERTS {
        assert!(
            names.iter().any(|n| n == required),
            "no alert {required} in {names:?}"
        );
    }
}

#[test]
fn every_alert_fires_and_holds_back_in_the_unit_test() {
    let test_file = deploy_dir().join(RULES_TEST_FILE);
    test_rules(&test_file).unwrap_or_else(|e| panic!("{e}"));

    let unit = yaml(&test_file);
    assert_eq!(unit["rule_files"], serde_json::json!([RULES_FILE]));
    let cases: Vec<&Value> = unit["tests"]
        .as_array()
        .expect("`tests` is a list")
        .iter()
        .flat_map(|t| t["alert_rule_test"].as_array().into_iter().flatten())
        .collect();
    for (name, _) in alerts() {
        let expected: Vec<usize> = cases
            .iter()
            .filter(|c| c["alertname"] == name.as_str())
            .map(|c| c["exp_alerts"].as_array().map_or(0, Vec::len))
            .collect();
        assert!(
            expected.iter().any(|&n| n > 0),
            "{name} never fires in {RULES_TEST_FILE}"
        );
        assert!(
            expected.contains(&0),
            "{name} is never shown not to fire in {RULES_TEST_FILE}"
        );
    }
}

/// The unit test has teeth: the map alert's threshold moved from 80% to 90% makes it fail on
/// that alert, and an expression promtool cannot parse fails the check.
#[test]
fn a_changed_rule_fails_the_unit_test() {
    let dir = std::env::temp_dir().join(capture_tests::unique("alerts"));
    std::fs::create_dir_all(&dir).unwrap();
    let original = std::fs::read_to_string(rules_file()).unwrap();
    let threshold = "capture_map_capacity > 0.8";
    assert!(
        original.contains(threshold),
        "the map alert's threshold moved"
    );
    std::fs::write(
        dir.join(RULES_FILE),
        original.replace(threshold, "capture_map_capacity > 0.9"),
    )
    .unwrap();
    std::fs::copy(
        deploy_dir().join(RULES_TEST_FILE),
        dir.join(RULES_TEST_FILE),
    )
    .unwrap();
    let failed = test_rules(&dir.join(RULES_TEST_FILE));

    let broken = dir.join("broken.yaml");
    std::fs::write(&broken, original.replace("== 0\n", "== \n")).unwrap();
    let unparsable = check_rules(&broken);
    std::fs::remove_dir_all(&dir).unwrap();

    let report = failed.expect_err("a 90% threshold passed the 87.5% case");
    assert!(report.contains("CaptureMapFilling"), "{report}");
    let report = unparsable.expect_err("`up == ` passed promtool check rules");
    assert!(report.contains("parse error"), "{report}");
}

#[test]
fn the_prometheus_rule_carries_the_same_groups() {
    let plain = yaml(&rules_file());
    let operator = yaml(&deploy_dir().join(PROMETHEUS_RULE_FILE));
    assert_eq!(operator["apiVersion"], "monitoring.coreos.com/v1");
    assert_eq!(operator["kind"], "PrometheusRule");
    // Beside the DaemonSet whose agents it watches.
    let daemonset = yaml_documents(&deploy_dir().join("capture.yaml"))
        .into_iter()
        .find(|d| d["kind"] == "DaemonSet" && d["metadata"]["name"] == "capture-node")
        .expect("deploy/capture.yaml's DaemonSet capture-node");
    assert_eq!(
        operator["metadata"]["namespace"],
        daemonset["metadata"]["namespace"]
    );
    assert!(!rules(&plain["groups"]).is_empty());
    assert_eq!(
        operator["spec"]["groups"], plain["groups"],
        "{PROMETHEUS_RULE_FILE}'s spec.groups differ from {RULES_FILE}'s groups: edit both"
    );
}

#[test]
fn every_alert_has_a_severity_its_texts_and_a_runbook_section() {
    let runbooks_file = Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/using/runbooks.md");
    let runbooks = std::fs::read_to_string(&runbooks_file)
        .unwrap_or_else(|e| panic!("reading {}: {e}", runbooks_file.display()));
    let anchors = heading_anchors(&runbooks);
    for (name, rule) in alerts() {
        let severity = &rule["labels"]["severity"];
        assert!(
            severity == "critical" || severity == "warning",
            "{name}: severity {severity}"
        );
        let annotations = &rule["annotations"];
        for key in ["summary", "description"] {
            let said = text(&annotations[key], &format!("{name}'s {key}"));
            // An alert that names no node or pod leaves the operator to find it.
            assert!(
                said.contains("{{ $labels."),
                "{name}'s {key} names nothing: {said}"
            );
        }
        let url = text(
            &annotations["runbook_url"],
            &format!("{name}'s runbook_url"),
        );
        let anchor = url
            .strip_prefix(RUNBOOKS_URL)
            .and_then(|rest| rest.strip_prefix('#'))
            .unwrap_or_else(|| panic!("{name}: {url} is not {RUNBOOKS_URL}#ANCHOR"));
        assert!(
            anchors.iter().any(|a| a == anchor),
            "{name}: docs/using/runbooks.md has no heading whose anchor is {anchor}"
        );
    }
    // The `up` alerts match the job that the runbook's scrape config and PodMonitor give.
    let all = alerts();
    for alert in ["CaptureAgentDown", "CaptureAgentsAbsent"] {
        let (_, rule) = all
            .iter()
            .find(|(name, _)| name == alert)
            .unwrap_or_else(|| panic!("no alert {alert}"));
        let expr = text(&rule["expr"], "expr");
        assert!(
            expr.contains(r#"up{job="capture-node"}"#),
            "{alert}: {expr}"
        );
    }
    assert!(
        runbooks.contains("job_name: capture-node"),
        "the scrape config's job"
    );
    assert!(
        runbooks.contains("replacement: capture-node"),
        "the PodMonitor's job"
    );
}
