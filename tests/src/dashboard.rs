//! deploy/grafana-dashboard.json read as Grafana imports it and as its panels query: the checks
//! the userspace tier's dashboard test runs against a real agent's exposition and a real
//! Prometheus. A query that names a series the agent does not export, draws a counter raw or
//! rates a gauge, escapes the node variable, is refused by Prometheus or shows nothing is reported
//! with its panel's title.

use std::collections::{BTreeMap, BTreeSet};

use serde_json::Value;

use crate::prometheus::Prometheus;

pub const DASHBOARD_FILE: &str = "grafana-dashboard.json";

/// What Grafana puts in the place of each variable the queries use. `$__rate_interval` is at
/// least four scrape intervals in Grafana; five minutes outlast a test's patience for its
/// series, so a rate keeps the samples from before the test's ADDs as long as it waits.
const SUBSTITUTIONS: &[(&str, &str)] = &[
    ("$__rate_interval", "5m"),
    ("${instance}", ".*"),
    ("$instance", ".*"),
];

/// The matcher that keeps each selector to the nodes picked in the `instance` variable.
const INSTANCE_MATCHER: &str = "instance=~\"$instance\"";

/// Functions that make sense only over a counter (or a histogram's buckets).
const COUNTER_FUNCTIONS: &[&str] = &["rate", "irate", "increase", "resets"];

/// One query of one panel.
#[derive(Clone, Debug)]
pub struct Target {
    pub panel: String,
    pub ref_id: String,
    pub expr: String,
}

impl Target {
    fn named(&self) -> String {
        format!("panel \"{}\" ({})", self.panel, self.ref_id)
    }
}

/// The dashboard file, parsed.
#[must_use]
pub fn load() -> Value {
    let file = crate::promtool::deploy_dir().join(DASHBOARD_FILE);
    let text = std::fs::read_to_string(&file)
        .unwrap_or_else(|e| panic!("reading {}: {e}", file.display()));
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", file.display()))
}

/// Every panel, rows' nested panels included (a collapsed row holds its panels).
fn panels(dashboard: &Value) -> Vec<&Value> {
    let top = dashboard["panels"].as_array().into_iter().flatten();
    top.flat_map(|p| {
        let nested = p["panels"].as_array().into_iter().flatten();
        std::iter::once(p).chain(nested)
    })
    .collect()
}

/// Every query of every panel.
#[must_use]
pub fn targets(dashboard: &Value) -> Vec<Target> {
    panels(dashboard)
        .into_iter()
        .flat_map(|p| {
            let panel = p["title"].as_str().unwrap_or_default().to_owned();
            p["targets"]
                .as_array()
                .into_iter()
                .flatten()
                .map(move |t| Target {
                    panel: panel.clone(),
                    ref_id: t["refId"].as_str().unwrap_or_default().to_owned(),
                    expr: t["expr"].as_str().unwrap_or_default().to_owned(),
                })
        })
        .collect()
}

/// The template variable `name`.
fn variable<'a>(dashboard: &'a Value, name: &str) -> Option<&'a Value> {
    dashboard["templating"]["list"]
        .as_array()?
        .iter()
        .find(|v| v["name"] == name)
}

/// The `label_values(METRIC, LABEL)` query of the variable `name`: (metric, label).
#[must_use]
pub fn label_values_of(dashboard: &Value, name: &str) -> Option<(String, String)> {
    let var = variable(dashboard, name)?;
    let query = var["query"]["query"].as_str().or(var["query"].as_str())?;
    let inner = query
        .trim()
        .strip_prefix("label_values(")?
        .strip_suffix(')')?;
    let (metric, label) = inner.split_once(',')?;
    Some((metric.trim().to_owned(), label.trim().to_owned()))
}

/// What keeps Grafana from importing the dashboard as one that follows the `datasource` and
/// `instance` variables: empty when nothing does.
#[must_use]
pub fn import_problems(dashboard: &Value) -> Vec<String> {
    let mut problems = Vec::new();
    let mut need = |ok: bool, what: &dyn Fn() -> String| {
        if !ok {
            problems.push(what());
        }
    };
    let uid = dashboard["uid"].as_str().unwrap_or_default();
    need(!uid.is_empty() && uid.len() <= 40, &|| {
        format!("uid {uid:?}: 1 to 40 characters")
    });
    need(
        dashboard["title"].as_str().is_some_and(|t| !t.is_empty()),
        &|| "no title".into(),
    );
    need(
        dashboard["schemaVersion"].as_u64().is_some_and(|v| v >= 36),
        &|| format!("schemaVersion {}", dashboard["schemaVersion"]),
    );
    need(
        variable(dashboard, "datasource")
            .is_some_and(|v| v["type"] == "datasource" && v["query"] == "prometheus"),
        &|| "no variable `datasource` of type datasource, query prometheus".into(),
    );
    need(
        variable(dashboard, "instance")
            .is_some_and(|v| v["type"] == "query" && is_variable_source(&v["datasource"])),
        &|| "no variable `instance` of type query on ${datasource}".into(),
    );
    need(label_values_of(dashboard, "instance").is_some(), &|| {
        "the `instance` variable is no label_values(METRIC, LABEL)".into()
    });
    let all = panels(dashboard);
    need(!all.is_empty(), &|| "no panels".into());
    let mut ids = BTreeSet::new();
    let mut of_panels = Vec::new();
    for p in &all {
        let title = p["title"].as_str().unwrap_or_default();
        need(!title.is_empty(), &|| {
            format!("a panel without a title: {p}")
        });
        need(p["id"].as_u64().is_some_and(|id| ids.insert(id)), &|| {
            format!("panel \"{title}\": id {} missing or not unique", p["id"])
        });
        need(Place::of(p).is_some(), &|| {
            format!("panel \"{title}\": gridPos {} off the grid", p["gridPos"])
        });
        if p["type"] != "row" {
            of_panels.extend(panel_problems(p, title));
        }
    }
    problems.extend(of_panels);
    problems.extend(overlaps(&all));
    problems
}

/// A query panel's own problems: its description, data source and targets.
fn panel_problems(p: &Value, title: &str) -> Vec<String> {
    let mut problems = Vec::new();
    if p["description"].as_str().is_none_or(str::is_empty) {
        problems.push(format!("panel \"{title}\": no description"));
    }
    if !is_variable_source(&p["datasource"]) {
        problems.push(format!(
            "panel \"{title}\": datasource {} is not the variable",
            p["datasource"]
        ));
    }
    let targets = p["targets"].as_array().map_or(&[][..], Vec::as_slice);
    if targets.is_empty() {
        problems.push(format!("panel \"{title}\": no targets"));
    }
    let mut refs = BTreeSet::new();
    for t in targets {
        let ref_id = t["refId"].as_str().unwrap_or_default();
        if ref_id.is_empty() || !refs.insert(ref_id) {
            problems.push(format!(
                "panel \"{title}\": refId {ref_id:?} empty or repeated"
            ));
        }
        if t["expr"].as_str().is_none_or(str::is_empty) {
            problems.push(format!("panel \"{title}\" ({ref_id}): no expr"));
        }
        if !t["datasource"].is_null() && !is_variable_source(&t["datasource"]) {
            problems.push(format!(
                "panel \"{title}\" ({ref_id}): datasource {}",
                t["datasource"]
            ));
        }
    }
    problems
}

fn is_variable_source(datasource: &Value) -> bool {
    datasource["type"] == "prometheus" && datasource["uid"] == "${datasource}"
}

/// A panel's place on Grafana's 24-column grid.
#[derive(Clone, Copy, Debug)]
struct Place {
    x: u64,
    y: u64,
    width: u64,
    height: u64,
}

impl Place {
    fn of(panel: &Value) -> Option<Self> {
        let at = |key: &str| panel["gridPos"][key].as_u64();
        let place = Self {
            x: at("x")?,
            y: at("y")?,
            width: at("w")?,
            height: at("h")?,
        };
        (place.width > 0 && place.height > 0 && place.x + place.width <= 24).then_some(place)
    }

    fn overlaps(self, other: Self) -> bool {
        self.x < other.x + other.width
            && other.x < self.x + self.width
            && self.y < other.y + other.height
            && other.y < self.y + self.height
    }
}

/// Panels drawn over one another.
fn overlaps(all: &[&Value]) -> Vec<String> {
    let placed: Vec<(&str, Place)> = all
        .iter()
        .filter_map(|p| Some((p["title"].as_str().unwrap_or_default(), Place::of(p)?)))
        .collect();
    let mut problems = Vec::new();
    for (i, (a, place_a)) in placed.iter().enumerate() {
        for (b, place_b) in &placed[i + 1..] {
            if place_a.overlaps(*place_b) {
                problems.push(format!("panels \"{a}\" and \"{b}\" overlap"));
            }
        }
    }
    problems
}

/// `expr` with the Grafana variables replaced as Grafana would; Err when one is left that this
/// test does not know how to replace.
///
/// # Errors
/// A `$` left in the expression.
pub fn as_queried(expr: &str) -> Result<String, String> {
    let queried = SUBSTITUTIONS
        .iter()
        .fold(expr.to_owned(), |e, (var, value)| e.replace(var, value));
    if queried.contains('$') {
        return Err(format!("a variable this test cannot replace in {expr}"));
    }
    Ok(queried)
}

/// A `capture_` series an expression names: its name, the functions it is inside of (innermost
/// last) and its label matchers.
#[derive(Debug, PartialEq, Eq)]
pub struct Named {
    pub name: String,
    pub inside: Vec<String>,
    pub matchers: String,
}

/// Every `capture_` series `expr` names, outside quoted strings.
#[must_use]
pub fn named_series(expr: &str) -> Vec<Named> {
    let chars: Vec<char> = expr.chars().collect();
    let mut found = Vec::new();
    // The function (or `by`, or nothing) of each open parenthesis.
    let mut open: Vec<String> = Vec::new();
    let mut last_word = String::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c == '"' || c == '\'' || c == '`' {
            i = past_string(&chars, i);
            last_word.clear();
            continue;
        }
        if c.is_ascii_alphabetic() || c == '_' || c == ':' {
            let start = i;
            while i < chars.len()
                && (chars[i].is_ascii_alphanumeric() || matches!(chars[i], '_' | ':'))
            {
                i += 1;
            }
            let word: String = chars[start..i].iter().collect();
            if word.starts_with("capture_") {
                let mut at = i;
                while chars.get(at).is_some_and(|c| c.is_whitespace()) {
                    at += 1;
                }
                let matchers = if chars.get(at) == Some(&'{') {
                    let end = selector_end(&chars, at);
                    i = end;
                    chars[at + 1..end.saturating_sub(1)].iter().collect()
                } else {
                    String::new()
                };
                found.push(Named {
                    name: word.clone(),
                    inside: open.iter().filter(|f| !f.is_empty()).cloned().collect(),
                    matchers,
                });
            }
            last_word = word;
            continue;
        }
        if c.is_ascii_digit() {
            // A number or a duration (`5m`): no name starts with a digit.
            while i < chars.len() && chars[i].is_ascii_alphanumeric() {
                i += 1;
            }
            last_word.clear();
            continue;
        }
        match c {
            '(' => open.push(std::mem::take(&mut last_word)),
            ')' => {
                open.pop();
                last_word.clear();
            }
            _ if c.is_whitespace() => {}
            _ => last_word.clear(),
        }
        i += 1;
    }
    found
}

/// The index past the string literal that opens at `start`.
fn past_string(chars: &[char], start: usize) -> usize {
    let quote = chars[start];
    let mut i = start + 1;
    while i < chars.len() && chars[i] != quote {
        i += if chars[i] == '\\' { 2 } else { 1 };
    }
    i + 1
}

/// The index past the `}` that closes the selector opening at `start`.
fn selector_end(chars: &[char], start: usize) -> usize {
    let mut i = start + 1;
    while i < chars.len() && chars[i] != '}' {
        i = if matches!(chars[i], '"' | '\'' | '`') {
            past_string(chars, i)
        } else {
            i + 1
        };
    }
    i + 1
}

/// The agent's `/metrics` as families: each `# TYPE`'s name, its type and how many samples it
/// has in the scrape.
#[derive(Debug, Default)]
pub struct Exposition {
    families: BTreeMap<String, (String, usize)>,
}

impl Exposition {
    #[must_use]
    pub fn parse(text: &str) -> Self {
        let mut families = BTreeMap::new();
        for line in text.lines() {
            if let Some(declared) = line.strip_prefix("# TYPE ") {
                let mut words = declared.split_whitespace();
                if let (Some(name), Some(kind)) = (words.next(), words.next()) {
                    families.insert(name.to_owned(), (kind.to_owned(), 0));
                }
            }
        }
        let mut exposition = Self { families };
        for line in text.lines().filter(|l| !l.starts_with('#')) {
            let name = line.split(['{', ' ']).next().unwrap_or_default();
            if let Some((family, _)) = exposition.family_of(name) {
                let family = family.to_owned();
                if let Some((_, samples)) = exposition.families.get_mut(&family) {
                    *samples += 1;
                }
            }
        }
        exposition
    }

    /// The family a series name belongs to and its type: the name itself, or a histogram's or
    /// summary's `_bucket`, `_sum` and `_count`.
    #[must_use]
    pub fn family_of(&self, series: &str) -> Option<(&str, &str)> {
        if let Some((name, (kind, _))) = self.families.get_key_value(series) {
            return Some((name, kind));
        }
        ["_bucket", "_sum", "_count"].iter().find_map(|suffix| {
            let base = series.strip_suffix(suffix)?;
            let (name, (kind, _)) = self.families.get_key_value(base)?;
            matches!(kind.as_str(), "histogram" | "summary")
                .then_some((name.as_str(), kind.as_str()))
        })
    }

    /// Adds a family the agent exports only once it has counted something of it, without
    /// samples: what a scrape of that agent would hold before its first count.
    pub fn declare(&mut self, family: &str, kind: &str) {
        self.families
            .entry(family.to_owned())
            .or_insert_with(|| (kind.to_owned(), 0));
    }

    /// How many samples the family has in the scrape.
    #[must_use]
    pub fn samples(&self, family: &str) -> usize {
        self.families.get(family).map_or(0, |(_, n)| *n)
    }
}

/// What is wrong with `expr` before it is run: a name the agent does not export, a counter drawn
/// raw or a gauge rated, a selector the `instance` variable does not narrow.
#[must_use]
pub fn expr_problems(expr: &str, exposition: &Exposition) -> Vec<String> {
    let named = named_series(expr);
    if named.is_empty() {
        return vec![format!("names no capture_ series: {expr}")];
    }
    let mut problems = Vec::new();
    for n in &named {
        if !n.matchers.contains(INSTANCE_MATCHER) {
            problems.push(format!("{} without {INSTANCE_MATCHER}", n.name));
        }
        let Some((family, kind)) = exposition.family_of(&n.name) else {
            problems.push(format!("{} is not in the agent's /metrics", n.name));
            continue;
        };
        let histogram = matches!(kind, "histogram" | "summary");
        if histogram && n.name == family {
            problems.push(format!(
                "{} is a {kind}: its series are _bucket, _sum and _count",
                n.name
            ));
            continue;
        }
        let rated = n
            .inside
            .iter()
            .any(|f| COUNTER_FUNCTIONS.contains(&f.as_str()));
        // A histogram's buckets, sum and count only ever grow, as counters do.
        let counts = kind == "counter" || histogram;
        if counts && !rated {
            problems.push(format!("{} ({kind}) outside rate() or increase()", n.name));
        }
        if !counts && rated {
            problems.push(format!("{} ({kind}) inside {:?}", n.name, n.inside));
        }
    }
    problems
}

/// What a query gave.
#[derive(Debug)]
pub enum Answer {
    /// This many samples, at least one of them a number.
    Data(usize),
    /// Nothing, because the named families have no sample in the agent's scrape: the series
    /// exist only once the agent has counted something of that kind.
    NotExported(Vec<String>),
}

/// What is wrong with a target, its panel named.
#[derive(Debug)]
pub enum Problem {
    /// The query itself: no waiting mends it.
    Broken(String),
    /// No data yet: a later scrape may bring it.
    Empty(String),
}

impl std::fmt::Display for Problem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Broken(what) => write!(f, "{what}"),
            Self::Empty(what) => write!(f, "{what}"),
        }
    }
}

/// Runs one target through every check.
///
/// # Errors
/// Anything of [`expr_problems`] or Prometheus' refusal ([`Problem::Broken`]), or an answer
/// without a number in it ([`Problem::Empty`]).
pub fn check_target(
    prometheus: &Prometheus,
    exposition: &Exposition,
    target: &Target,
) -> Result<Answer, Problem> {
    let broken = |what: String| Problem::Broken(format!("{}: {what}", target.named()));
    let problems = expr_problems(&target.expr, exposition);
    if !problems.is_empty() {
        return Err(broken(problems.join("; ")));
    }
    let queried = as_queried(&target.expr).map_err(broken)?;
    let samples = prometheus.try_query(&queried).map_err(broken)?;
    if samples.iter().any(|s| !s.value.is_nan()) {
        return Ok(Answer::Data(samples.len()));
    }
    let silent: Vec<String> = named_series(&target.expr)
        .into_iter()
        .filter_map(|n| exposition.family_of(&n.name).map(|(f, _)| f.to_owned()))
        .filter(|family| exposition.samples(family) == 0)
        .collect();
    if samples.is_empty() && !silent.is_empty() {
        return Ok(Answer::NotExported(silent));
    }
    Err(Problem::Empty(format!(
        "{}: no data: {queried} gave {samples:?}",
        target.named()
    )))
}

#[cfg(test)]
#[path = "dashboard_tests.rs"]
mod tests;
