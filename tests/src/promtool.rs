//! promtool (Prometheus's own tool, from Debian's `prometheus` package, installed by `cargo xtask
//! setup`): `check metrics` on an exposition, Prometheus's text-format parser plus its lints (help
//! text, counter and unit naming, reserved label names); `check rules` and `test rules` on the
//! alerts of deploy/; and the Markdown anchors their runbook links point at.

use std::{
    io::Write as _,
    path::{Path, PathBuf},
    process::{Command, Stdio},
};

/// The plain Prometheus rules file, in deploy/.
pub const RULES_FILE: &str = "prometheus-rules.yaml";
/// Its `promtool test rules` unit test, beside it (it names the rules file relative to itself).
pub const RULES_TEST_FILE: &str = "prometheus-rules.test.yaml";
/// The same groups as a prometheus-operator `PrometheusRule`.
pub const PROMETHEUS_RULE_FILE: &str = "prometheus-rule.yaml";

/// This repository's deploy/ directory.
pub fn deploy_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../deploy")
}

/// Runs `promtool check rules` on `file`: Ok with the number of rules it found, Err with
/// everything it said when it found a problem.
pub fn check_rules(file: &Path) -> Result<usize, String> {
    let (ok, said) = promtool(&["check", "rules"], file);
    let found = said
        .lines()
        .find_map(|l| l.trim().strip_prefix("SUCCESS: "))
        .and_then(|l| l.strip_suffix(" rules found"))
        .and_then(|n| n.parse().ok());
    match (ok, found) {
        (true, Some(n)) => Ok(n),
        _ => Err(format!("promtool check rules {}: {said}", file.display())),
    }
}

/// Runs `promtool test rules` on the unit-test file `file`. Err holds promtool's report: the
/// alerts that were expected and not found, or found and not expected, with their labels and
/// annotations.
pub fn test_rules(file: &Path) -> Result<(), String> {
    let (ok, said) = promtool(&["test", "rules"], file);
    if ok {
        Ok(())
    } else {
        Err(format!("promtool test rules {}: {said}", file.display()))
    }
}

/// Whether promtool exited 0, and its stdout and stderr.
fn promtool(args: &[&str], file: &Path) -> (bool, String) {
    let out = Command::new("promtool")
        .args(args)
        .arg(file)
        .output()
        .unwrap_or_else(|e| {
            panic!("running promtool: {e}; `cargo xtask setup` installs it (Debian package prometheus)")
        });
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), said)
}

/// The anchor GitHub gives a Markdown heading: lower case, punctuation dropped, spaces turned
/// into hyphens (hyphens and underscores stay).
pub fn github_anchor(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The anchors of a Markdown document's headings (`#` lines outside code fences), in order.
pub fn heading_anchors(markdown: &str) -> Vec<String> {
    let mut in_fence = false;
    let mut anchors = Vec::new();
    for line in markdown.lines() {
        if line.trim_start().starts_with("```") {
            in_fence = !in_fence;
            continue;
        }
        let level = line.chars().take_while(|&c| c == '#').count();
        if !in_fence && (1..=6).contains(&level) && line[level..].starts_with(' ') {
            anchors.push(github_anchor(&line[level..]));
        }
    }
    anchors
}

/// Runs promtool on `exposition`. Err holds everything it reported: a parse error, or any lint
/// problem (promtool then exits 3), or any output at all, which it gives only for problems.
pub fn check_metrics(exposition: &str) -> Result<(), String> {
    let mut child = Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| {
            panic!("running promtool: {e}; `cargo xtask setup` installs it (Debian package prometheus)")
        });
    child
        .stdin
        .take()
        .expect("promtool's stdin")
        .write_all(exposition.as_bytes())
        .expect("writing the exposition to promtool");
    let out = child.wait_with_output().expect("waiting for promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(format!("promtool check metrics ({}): {said}", out.status))
    }
}

/// The text format's rule that promtool 2.42 does not check: all lines of a family form one
/// group, so every sample follows the TYPE line of its own family and no family is declared
/// twice. Prometheus's OpenMetrics parser, and other consumers, reject interleaved families.
pub fn check_grouping(exposition: &str) -> Result<(), String> {
    let mut declared: Vec<(&str, &str)> = Vec::new();
    for line in exposition.lines() {
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, ""));
            if declared.iter().any(|(n, _)| *n == name) {
                return Err(format!("family {name} is declared twice"));
            }
            declared.push((name, kind));
        } else if !line.starts_with('#') && !line.is_empty() {
            let sample = line.split(['{', ' ']).next().unwrap_or_default();
            let Some(&(family, kind)) = declared.last() else {
                return Err(format!("{sample} comes before any TYPE line"));
            };
            let suffixes: &[&str] = match kind {
                "histogram" => &["_bucket", "_sum", "_count"],
                "summary" => &["", "_sum", "_count"],
                _ => &[""],
            };
            if !suffixes.iter().any(|s| sample == format!("{family}{s}")) {
                return Err(format!(
                    "{sample} is outside its family's group (it follows TYPE {family})"
                ));
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{check_grouping, check_metrics, github_anchor, heading_anchors};

    #[test]
    fn anchors_are_githubs() {
        assert_eq!(github_anchor(" CaptureAgentDown"), "captureagentdown");
        assert_eq!(
            github_anchor("Loading the rules: plain, or PrometheusRule"),
            "loading-the-rules-plain-or-prometheusrule"
        );
        assert_eq!(github_anchor("The `up` job"), "the-up-job");
        let doc = "# Title\n\n```sh\n# not a heading\n```\n## Two words\n#hashtag\n";
        assert_eq!(heading_anchors(doc), ["title", "two-words"]);
    }

    #[test]
    fn interleaved_families_are_found() {
        let grouped = "# TYPE a gauge\na{x=\"1\"} 1\na{x=\"2\"} 1\n# TYPE h histogram\n\
                       h_bucket{le=\"+Inf\"} 1\nh_sum 1\nh_count 1\n";
        assert_eq!(check_grouping(grouped), Ok(()));
        let interleaved = "# TYPE a gauge\n# TYPE b gauge\na 1\nb 1\n";
        assert!(check_grouping(interleaved).is_err());
        let twice = "# TYPE a gauge\na 1\n# TYPE a gauge\na{x=\"1\"} 1\n";
        assert!(check_grouping(twice).is_err());
    }

    /// The check finds problems when there are some, so a clean result means something.
    #[test]
    fn promtool_reports_lint_problems_and_parse_errors() {
        let good = "# HELP x_total Things.\n# TYPE x_total counter\nx_total 1\n";
        assert_eq!(check_metrics(good), Ok(()));
        let no_help = "# TYPE x_total counter\nx_total 1\n";
        let err = check_metrics(no_help).expect_err("a counter without help");
        assert!(err.contains("no help text"), "{err}");
        let bad_suffix = "# HELP x Things.\n# TYPE x counter\nx 1\n";
        let err = check_metrics(bad_suffix).expect_err("a counter without _total");
        assert!(err.contains("_total"), "{err}");
        let unparsable = "x{a=\"1\" 1\n";
        assert!(check_metrics(unparsable).is_err());
    }
}
