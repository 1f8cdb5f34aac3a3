//! The checks of dashboard.rs on expressions and scrapes made up here: no agent or Prometheus.

use super::*;

const SCRAPE: &str = "\
# HELP capture_agent_ready Whether the agent serves capture requests.
# TYPE capture_agent_ready gauge
capture_agent_ready 1
# TYPE capture_agent_requests_total counter
capture_agent_requests_total{op=\"add\",result=\"ok\"} 2
# TYPE capture_attach_duration_seconds histogram
capture_attach_duration_seconds_sum 0.1
capture_attach_duration_seconds_count 2
capture_attach_duration_seconds_bucket{le=\"0.5\"} 2
";

fn problems(expr: &str) -> Vec<String> {
    expr_problems(expr, &Exposition::parse(SCRAPE))
}

#[test]
fn a_series_the_agent_does_not_export_is_named() {
    let found = problems("capture_no_such_series{instance=~\"$instance\"}");
    assert_eq!(
        found,
        ["capture_no_such_series is not in the agent's /metrics"]
    );
    // A histogram's suffixes belong to histograms only.
    let found = problems("rate(capture_agent_requests_bucket{instance=~\"$instance\"}[5m])");
    assert_eq!(found.len(), 1, "{found:?}");
}

#[test]
fn histograms_counters_and_gauges_are_read_as_their_type_asks() {
    let quantile = "histogram_quantile(0.9, sum by (le) (rate(capture_attach_duration_seconds_bucket{instance=~\"$instance\"}[$__rate_interval])))";
    assert_eq!(problems(quantile), Vec::<String>::new());
    let raw = problems("capture_agent_requests_total{instance=~\"$instance\"}");
    assert!(raw[0].contains("outside rate()"), "{raw:?}");
    let rated = problems("rate(capture_agent_ready{instance=~\"$instance\"}[1m])");
    assert!(rated[0].contains("inside [\"rate\"]"), "{rated:?}");
}

#[test]
fn a_selector_outside_the_instance_variable_and_names_in_strings() {
    let found = problems(
        "capture_agent_ready{pod=\"capture_x{\"} / capture_agent_ready{instance=~\"$instance\"}",
    );
    assert_eq!(
        found,
        ["capture_agent_ready without instance=~\"$instance\""]
    );
    let named = named_series("sum by (instance) (capture_agent_ready{job='capture_y'})");
    assert_eq!(named.len(), 1, "{named:?}");
    assert_eq!(named[0].matchers, "job='capture_y'");
}

#[test]
fn families_count_their_samples() {
    let mut exposition = Exposition::parse(SCRAPE);
    assert_eq!(exposition.samples("capture_attach_duration_seconds"), 3);
    assert_eq!(exposition.family_of("capture_repairs_total"), None);
    exposition.declare("capture_repairs_total", "counter");
    assert_eq!(exposition.samples("capture_repairs_total"), 0);
    assert_eq!(
        expr_problems(
            "increase(capture_repairs_total{instance=~\"$instance\"}[1m])",
            &exposition
        ),
        Vec::<String>::new()
    );
    assert_eq!(
        exposition.family_of("capture_attach_duration_seconds_count"),
        Some(("capture_attach_duration_seconds", "histogram"))
    );
}

#[test]
fn variables_are_replaced_or_refused() {
    assert_eq!(
        as_queried("rate(capture_x{instance=~\"$instance\"}[$__rate_interval])").unwrap(),
        "rate(capture_x{instance=~\".*\"}[5m])"
    );
    assert!(as_queried("capture_x{job=\"$job\"}").is_err());
}
