//! `promtool check metrics` (Prometheus's own tool, from Debian's `prometheus` package, installed
//! by `cargo xtask setup`) on an exposition: Prometheus's text-format parser plus its lints
//! (help text, counter and unit naming, reserved label names).

use std::{
    io::Write as _,
    process::{Command, Stdio},
};

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
    use super::{check_grouping, check_metrics};

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
