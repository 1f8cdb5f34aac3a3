//! The node's policy for bypass annotations: which of a pod's traffic annotations it may use,
//! and within which bounds, by namespace and pod labels. A pod that breaks a rule is not
//! captured, and its ADD fails naming the annotation and the rule (fail closed). Without a
//! policy, every annotation is Istio's to honour, except the ones that name a pod's own exempt
//! proxy ids (`capture.dev/proxy-uid`, `capture.dev/proxy-gid`), which need a rule that allows
//! them: a pod that names its own exempt uid is a bypass.
//!
//! ```yaml
//! rules:
//! - name: tenants
//!   namespaces: [team-a, "team-*"]        # exact names, or a prefix ending in *
//!   podSelector: {matchLabels: {tier: web}} # optional, against the sandbox's labels
//!   annotations:
//!     traffic.sidecar.istio.io/excludeOutboundIPRanges: {within: [10.96.0.0/12]}
//!     traffic.sidecar.istio.io/excludeOutboundPorts: deny
//!     capture.dev/proxy-identity: {values: [container]}
//!     capture.dev/proxy-uid: {ids: ["1000680000-1000689999"]}
//! ```

use std::collections::BTreeMap;

use ipnet::IpNet;
use serde::Deserialize;

use super::{values::parse_cidrs, values::parse_ports};

/// A pod's own proxy uid (the per-namespace uid ranges of `OpenShift`), honoured only where a
/// rule allows it.
pub const ANN_PROXY_UID: &str = "capture.dev/proxy-uid";
/// A pod's own proxy gid (default: its proxy uid).
pub const ANN_PROXY_GID: &str = "capture.dev/proxy-gid";

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Policy {
    #[serde(default)]
    pub rules: Vec<Rule>,
}

#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct Rule {
    pub name: String,
    /// Namespaces the rule holds in (absent: every namespace).
    #[serde(default)]
    pub namespaces: Option<Vec<String>>,
    #[serde(default)]
    pub pod_selector: Option<PodSelector>,
    /// Per annotation, what the pod may write there.
    pub annotations: BTreeMap<String, Allowed>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub struct PodSelector {
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

/// What a rule allows in one annotation.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(try_from = "AllowedText")]
pub enum Allowed {
    /// Not at all: `deny`.
    Deny,
    /// Only these exact values (trimmed).
    Values(Vec<String>),
    /// A CIDR list whose every range lies within one of these.
    Within(Vec<IpNet>),
    /// A port list whose every port lies in one of these (`8080` or `9000-9100`).
    Ports(Ranges),
    /// An id list whose every id lies in one of these (`1337` or `1000680000-1000689999`).
    Ids(Ranges),
}

/// Inclusive number ranges, as the policy wrote them (`N` or `N-M`) and parsed once.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Ranges {
    written: Vec<String>,
    bounds: Vec<(u64, u64)>,
}

impl Ranges {
    fn parse(written: Vec<String>) -> Result<Self, String> {
        let bounds = written
            .iter()
            .map(|r| range(r).ok_or_else(|| format!("{r:?} is not N or N-M")))
            .collect::<Result<_, _>>()?;
        Ok(Self { written, bounds })
    }

    fn contains(&self, n: u64) -> bool {
        self.bounds.iter().any(|&(lo, hi)| (lo..=hi).contains(&n))
    }
}

/// `deny`, or one bound: `{values: …}`, `{within: …}`, `{ports: …}` or `{ids: …}`.
#[derive(Deserialize)]
#[serde(untagged)]
enum AllowedText {
    Word(String),
    Bound(Bound),
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct Bound {
    values: Option<Vec<String>>,
    within: Option<Vec<IpNet>>,
    ports: Option<Vec<String>>,
    ids: Option<Vec<String>>,
}

impl TryFrom<AllowedText> for Allowed {
    type Error = String;

    fn try_from(text: AllowedText) -> Result<Self, String> {
        const EXPECTED: &str =
            "expected deny, or one of {values: [...]}, {within: [CIDR...]}, {ports: [N or N-M...]}, {ids: [N or N-M...]}";
        match text {
            AllowedText::Word(w) if w == "deny" => Ok(Self::Deny),
            AllowedText::Word(w) => Err(format!("{w:?}: {EXPECTED}")),
            AllowedText::Bound(b) => match (b.values, b.within, b.ports, b.ids) {
                (Some(v), None, None, None) => Ok(Self::Values(v)),
                (None, Some(w), None, None) => Ok(Self::Within(w)),
                (None, None, Some(p), None) => Ranges::parse(p).map(Self::Ports),
                (None, None, None, Some(i)) => Ranges::parse(i).map(Self::Ids),
                _ => Err(EXPECTED.into()),
            },
        }
    }
}

/// The pod as the policy sees it.
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub namespace: Option<&'a str>,
    /// `None` where the runtime has not reported them (a CNI ADD under containerd, which sets
    /// the network up before it lists the sandbox).
    pub labels: Option<&'a BTreeMap<String, String>>,
    pub annotations: &'a BTreeMap<String, String>,
}

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum PolicyError {
    #[error(
        "annotation {key}={value:?} is not allowed by the annotation policy's rule {rule:?}: {why}"
    )]
    Forbidden {
        key: String,
        value: String,
        rule: String,
        why: String,
    },
    #[error("annotation {key}={value:?} names the pod's own exempt proxy ids, which capture honours only where the annotation policy allows it; add a rule that allows {key} for the pod's namespace (see docs/using/proxy-identity.md)")]
    NotAllowed { key: String, value: String },
    #[error("annotation policy: {0}")]
    Malformed(String),
}

/// Reads a policy file's content.
///
/// # Errors
/// YAML that is not a policy, or a bound that does not parse (the error names where).
pub fn parse(text: &str) -> Result<Policy, PolicyError> {
    if text.trim().is_empty() {
        return Ok(Policy::default());
    }
    serde_yaml_ng::from_str(text).map_err(|e| PolicyError::Malformed(e.to_string()))
}

/// Reads a policy file.
///
/// # Errors
/// The file cannot be read or is not a policy; the error names it.
pub fn read(path: &std::path::Path) -> Result<Policy, PolicyError> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| PolicyError::Malformed(format!("{}: {e}", path.display())))?;
    parse(&text).map_err(|e| PolicyError::Malformed(format!("{}: {e}", path.display())))
}

fn range(text: &str) -> Option<(u64, u64)> {
    let text = text.trim();
    let (lo, hi) = text.split_once('-').unwrap_or((text, text));
    let (lo, hi) = (lo.trim().parse().ok()?, hi.trim().parse().ok()?);
    (lo <= hi).then_some((lo, hi))
}

impl Rule {
    /// Does the rule hold for the pod? A selector on labels the runtime has not reported holds
    /// (fail closed: the rule restricts, and restricting a pod it was not meant for costs an ADD,
    /// while sparing one it was meant for is a bypass).
    fn holds_for(&self, pod: &Subject<'_>) -> bool {
        let namespace_matches = match (&self.namespaces, pod.namespace) {
            (None, _) => true,
            (Some(_), None) => true,
            (Some(names), Some(ns)) => names.iter().any(|n| match n.strip_suffix('*') {
                Some(prefix) => ns.starts_with(prefix),
                None => n == ns,
            }),
        };
        let labels_match = match (&self.pod_selector, pod.labels) {
            (None, _) | (Some(_), None) => true,
            (Some(sel), Some(labels)) => sel
                .match_labels
                .iter()
                .all(|(k, v)| labels.get(k) == Some(v)),
        };
        namespace_matches && labels_match
    }
}

impl Policy {
    /// Checks the pod's annotations against every rule that holds for it.
    ///
    /// # Errors
    /// The first annotation a rule forbids, or a proxy-id annotation no rule allows.
    pub fn check(&self, pod: &Subject<'_>) -> Result<(), PolicyError> {
        let rules: Vec<&Rule> = self.rules.iter().filter(|r| r.holds_for(pod)).collect();
        for (key, value) in pod.annotations {
            for rule in &rules {
                if let Some(allowed) = rule.annotations.get(key) {
                    check_value(key, value, allowed).map_err(|why| PolicyError::Forbidden {
                        key: key.clone(),
                        value: value.clone(),
                        rule: rule.name.clone(),
                        why,
                    })?;
                }
            }
            let names_exempt_ids = key == ANN_PROXY_UID || key == ANN_PROXY_GID;
            if names_exempt_ids && !rules.iter().any(|r| r.annotations.contains_key(key)) {
                return Err(PolicyError::NotAllowed {
                    key: key.clone(),
                    value: value.clone(),
                });
            }
        }
        Ok(())
    }
}

/// Without a policy file: only the proxy-id annotations are refused.
///
/// # Errors
/// A proxy-id annotation.
pub fn check_without_policy(pod: &Subject<'_>) -> Result<(), PolicyError> {
    Policy::default().check(pod)
}

fn check_value(key: &str, value: &str, allowed: &Allowed) -> Result<(), String> {
    match allowed {
        Allowed::Deny => Err("the rule denies it".into()),
        Allowed::Values(values) => {
            if values.iter().any(|v| v.trim() == value.trim()) {
                Ok(())
            } else {
                Err(format!("allowed values are {values:?}"))
            }
        }
        Allowed::Within(bounds) => {
            let cidrs = parse_cidrs(key, value).map_err(|e| e.to_string())?;
            match cidrs
                .iter()
                .find(|c| !bounds.iter().any(|b| b.contains(*c)))
            {
                Some(wide) => Err(format!("{wide} is not within {bounds:?}")),
                None => Ok(()),
            }
        }
        Allowed::Ports(ranges) => {
            let ports = parse_ports(key, value).map_err(|e| e.to_string())?;
            match ports.iter().find(|p| !ranges.contains(u64::from(**p))) {
                Some(p) => Err(format!("port {p} is not in {:?}", ranges.written)),
                None => Ok(()),
            }
        }
        Allowed::Ids(ranges) => {
            for id in value.split(',') {
                let n: u64 = id
                    .trim()
                    .parse()
                    .map_err(|_| format!("{id:?} is not a number"))?;
                if !ranges.contains(n) {
                    return Err(format!("id {n} is not in {:?}", ranges.written));
                }
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const POLICY: &str = r#"
rules:
- name: tenants
  namespaces: [team-a, "team-b*"]
  annotations:
    traffic.sidecar.istio.io/excludeOutboundIPRanges: {within: [10.96.0.0/12]}
    traffic.sidecar.istio.io/excludeOutboundPorts: deny
    traffic.sidecar.istio.io/excludeInboundPorts: {ports: ["8080", "9000-9100"]}
    capture.dev/proxy-identity: {values: [container]}
    capture.dev/proxy-uid: {ids: ["1000680000-1000689999"]}
- name: web
  podSelector: {matchLabels: {tier: web}}
  annotations:
    traffic.sidecar.istio.io/includeOutboundIPRanges: {values: ["*"]}
"#;

    fn check(
        ns: &str,
        labels: Option<&[(&str, &str)]>,
        ann: &[(&str, &str)],
    ) -> Result<(), PolicyError> {
        let labels: Option<BTreeMap<String, String>> =
            labels.map(|l| l.iter().map(|(k, v)| ((*k).into(), (*v).into())).collect());
        let annotations = ann
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect();
        parse(POLICY).unwrap().check(&Subject {
            namespace: Some(ns),
            labels: labels.as_ref(),
            annotations: &annotations,
        })
    }

    #[test]
    fn forbidden_values_name_the_annotation_and_the_rule() {
        let ranges = "traffic.sidecar.istio.io/excludeOutboundIPRanges";
        let err = check("team-a", None, &[(ranges, "0.0.0.0/0")]).unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(ranges) && text.contains("\"tenants\"") && text.contains("0.0.0.0/0"),
            "{text}"
        );
        assert_eq!(check("team-a", None, &[(ranges, "10.96.1.0/24")]), Ok(()));
        assert_eq!(
            check("other", None, &[(ranges, "0.0.0.0/0")]),
            Ok(()),
            "another namespace"
        );
        assert!(check(
            "team-b2",
            None,
            &[("traffic.sidecar.istio.io/excludeOutboundPorts", "443")]
        )
        .is_err());
        let inbound = "traffic.sidecar.istio.io/excludeInboundPorts";
        assert_eq!(check("team-a", None, &[(inbound, "8080,9050")]), Ok(()));
        assert!(check("team-a", None, &[(inbound, "8080,22")]).is_err());
        assert!(check("team-a", None, &[("capture.dev/proxy-identity", "uid")]).is_err());
    }

    #[test]
    fn proxy_ids_need_a_rule_that_allows_them() {
        assert_eq!(
            check("team-a", None, &[(ANN_PROXY_UID, "1000680000")]),
            Ok(())
        );
        assert!(check("team-a", None, &[(ANN_PROXY_UID, "1337")]).is_err());
        let err = check("other", None, &[(ANN_PROXY_UID, "1000680000")]).unwrap_err();
        assert!(matches!(err, PolicyError::NotAllowed { .. }), "{err}");
        let annotations = [(ANN_PROXY_GID.to_string(), "5".to_string())].into();
        assert!(check_without_policy(&Subject {
            namespace: None,
            labels: None,
            annotations: &annotations
        })
        .is_err());
    }

    #[test]
    fn a_label_selector_holds_where_labels_are_unknown() {
        let include = "traffic.sidecar.istio.io/includeOutboundIPRanges";
        assert!(check("x", Some(&[("tier", "web")]), &[(include, "10.0.0.0/8")]).is_err());
        assert_eq!(
            check("x", Some(&[("tier", "db")]), &[(include, "10.0.0.0/8")]),
            Ok(())
        );
        assert!(
            check("x", None, &[(include, "10.0.0.0/8")]).is_err(),
            "fail closed"
        );
    }

    #[test]
    fn malformed_policies_say_where() {
        assert!(parse("rules: [{name: x, annotations: {a: {ports: [\"9-1\"]}}}]").is_err());
        assert!(parse("rules: [{name: x, annotations: {a: allow}}]").is_err());
        assert!(parse("rulez: []").is_err());
        assert_eq!(parse("").map(|p| p.rules.len()), Ok(0));
    }
}
