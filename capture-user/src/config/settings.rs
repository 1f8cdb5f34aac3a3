//! The pod settings that more than one place can decide, and where each pod's came from.
//!
//! Most specific first, as Istio decides them: the pod's annotations (a dedicated annotation,
//! then the fields of `proxy.istio.io/config`, which the injector merges over the mesh's
//! `defaultConfig`), then the mesh configuration the agent reads (`--mesh-config`), then the
//! agent's or the CLI's flags, then capture's default. `capture status` shows each pod's
//! settings with their source and what a less specific source said that it overrides.

use serde::{Deserialize, Serialize};

use super::{
    mesh_config::{DNS_CAPTURE, INVALID_DROP},
    proxy_config::{parse_switch, ProxyConfigAnnotation},
    values::bad,
    ConfigError, DnsCapture, InterceptionMode, PodSpec, ANN_INTERCEPTION_MODE, ANN_PROXY_CONFIG,
    DNS_PORT,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Annotation,
    Mesh,
    Flag,
    Default,
}

impl Source {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Annotation => "annotation",
            Self::Mesh => "mesh",
            Self::Flag => "flag",
            Self::Default => "default",
        }
    }
}

/// A value a less specific source gave, which the setting's source overrides.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Overridden {
    pub source: Source,
    pub from: String,
    pub value: String,
}

/// One effective setting of a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Setting {
    pub name: String,
    pub value: String,
    pub source: Source,
    /// Which annotation and field, mesh field or flag (empty for the default).
    pub from: String,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub overrides: Vec<Overridden>,
}

/// One place that gives a setting a value, as written there.
struct Candidate {
    source: Source,
    from: String,
    raw: String,
}

impl Candidate {
    fn new(source: Source, from: impl Into<String>, raw: impl Into<String>) -> Self {
        Self {
            source,
            from: from.into(),
            raw: raw.into(),
        }
    }
}

/// The most specific candidate's value. Every annotation's value is checked, even one that
/// loses, so that a pod's acceptance never depends on the mesh or the flags.
fn resolve<T: PartialEq>(
    name: &str,
    candidates: Vec<Candidate>,
    default: (T, &str),
    parse: impl Fn(&Candidate) -> Result<T, ConfigError>,
) -> Result<(T, Setting), ConfigError> {
    for c in candidates.iter().filter(|c| c.source == Source::Annotation) {
        parse(c)?;
    }
    let Some((winner, rest)) = candidates.split_first() else {
        let (value, shown) = default;
        return Ok((
            value,
            Setting {
                name: name.into(),
                value: shown.into(),
                source: Source::Default,
                from: String::new(),
                overrides: Vec::new(),
            },
        ));
    };
    let value = parse(winner)?;
    let overrides = rest
        .iter()
        .filter(|c| parse(c).ok().as_ref() != Some(&value))
        .map(|c| Overridden {
            source: c.source,
            from: c.from.clone(),
            value: c.raw.clone(),
        })
        .collect();
    Ok((
        value,
        Setting {
            name: name.into(),
            value: winner.raw.trim().to_string(),
            source: winner.source,
            from: winner.from.clone(),
            overrides,
        },
    ))
}

/// What a pod's settings resolve to.
pub(super) struct Resolved {
    pub interception_mode: InterceptionMode,
    pub dns: Option<DnsCapture>,
    pub drop_invalid: bool,
    pub settings: Vec<Setting>,
}

pub(super) fn resolve_pod(spec: &PodSpec) -> Result<Resolved, ConfigError> {
    let proxy_config = match spec.annotations.get(ANN_PROXY_CONFIG) {
        Some(text) => Some((text, ProxyConfigAnnotation::parse(text)?)),
        None => None,
    };
    let from_proxy_config = |field: &str| format!("{ANN_PROXY_CONFIG} {field}");
    let mesh = spec.mesh_config.as_ref();

    let mut modes = Vec::new();
    if let Some(v) = spec.annotations.get(ANN_INTERCEPTION_MODE) {
        modes.push(Candidate::new(Source::Annotation, ANN_INTERCEPTION_MODE, v));
    }
    if let Some(v) = proxy_config
        .as_ref()
        .and_then(|(_, p)| p.interception_mode.as_ref())
    {
        modes.push(Candidate::new(
            Source::Annotation,
            from_proxy_config("interceptionMode"),
            v,
        ));
    }
    if let Some(v) = mesh.and_then(|m| m.interception_mode.as_ref()) {
        modes.push(Candidate::new(
            Source::Mesh,
            "defaultConfig.interceptionMode",
            v,
        ));
    }
    let (interception_mode, mode_setting) = resolve(
        "interception_mode",
        modes,
        (InterceptionMode::Redirect, "REDIRECT"),
        |c| {
            match c.raw.trim() {
            "REDIRECT" => Ok(InterceptionMode::Redirect),
            "TPROXY" => Ok(InterceptionMode::Tproxy),
            _ => Err(match (c.source, proxy_config.as_ref()) {
                (Source::Annotation, Some((text, _))) if c.from != ANN_INTERCEPTION_MODE => bad(
                    ANN_PROXY_CONFIG,
                    text,
                    format!("interceptionMode={:?}: must be REDIRECT or TPROXY", c.raw),
                ),
                (Source::Annotation, _) => {
                    bad(ANN_INTERCEPTION_MODE, &c.raw, "must be REDIRECT or TPROXY")
                }
                _ => ConfigError::Mesh(format!(
                    "defaultConfig.interceptionMode={:?}: capture supports REDIRECT or TPROXY (istio-cni refuses the other modes too)",
                    c.raw
                )),
            }),
        }
        },
    )?;

    let switch = |key: &'static str, flag: (&str, bool)| {
        let mut candidates = Vec::new();
        if let Some(v) = proxy_config.as_ref().and_then(|(_, p)| p.metadata.get(key)) {
            candidates.push(Candidate::new(
                Source::Annotation,
                from_proxy_config(&format!("proxyMetadata.{key}")),
                v,
            ));
        }
        if let Some(on) = mesh.and_then(|m| m.metadata(key)) {
            candidates.push(Candidate::new(
                Source::Mesh,
                format!("defaultConfig.proxyMetadata.{key}"),
                on.to_string(),
            ));
        }
        // A flag can only turn a switch on: off is its absence.
        if flag.1 {
            candidates.push(Candidate::new(Source::Flag, flag.0, "true"));
        }
        candidates
    };
    let parse_switch_of = |c: &Candidate| {
        parse_switch(&c.raw).ok_or_else(|| {
            let text = proxy_config.as_ref().map_or("", |(t, _)| t.as_str());
            bad(
                ANN_PROXY_CONFIG,
                text,
                format!("{}={:?} is not true or false", c.from, c.raw),
            )
        })
    };
    let (dns_on, dns_setting) = resolve(
        "dns_capture",
        switch(DNS_CAPTURE, ("--redirect-dns", spec.mesh.redirect_dns)),
        (false, "false"),
        parse_switch_of,
    )?;
    let (drop_invalid, drop_setting) = resolve(
        "drop_invalid",
        switch(INVALID_DROP, ("--drop-invalid", spec.mesh.drop_invalid)),
        (false, "false"),
        parse_switch_of,
    )?;

    // On, without capture-all and without nameservers, DNS capture is off (as Istio's).
    let dns =
        (dns_on && (spec.mesh.capture_all_dns || !spec.mesh.nameservers.is_empty())).then(|| {
            DnsCapture {
                capture_all: spec.mesh.capture_all_dns,
                nameservers: spec.mesh.nameservers.clone(),
                port: DNS_PORT,
            }
        });
    Ok(Resolved {
        interception_mode,
        dns,
        drop_invalid,
        settings: vec![mode_setting, dns_setting, drop_setting],
    })
}
