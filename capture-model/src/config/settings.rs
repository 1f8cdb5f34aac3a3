//! The pod settings that more than one place can decide, and where each pod's came from.
//!
//! Most specific first, as Istio decides them. Once the runtime has created the pod's proxy
//! container, its environment and security context are istio-cni's whole source for DNS capture,
//! invalid-packet drops and the proxy's ids (`NewRedirect` in `cni/pkg/plugin/sidecar_redirect.go`:
//! an unset variable is off, a `runAsUser` of 0 or none is 1337), since the injector wrote the
//! merged ProxyConfig there. Before that (at ADD): the pod's annotations (a dedicated
//! annotation, then the fields of `proxy.istio.io/config`, which the injector merges over the
//! mesh's `defaultConfig`), then the mesh configuration of the pod's revision
//! (`--mesh-config`), then the agent's or the CLI's flags, then capture's default. The
//! interception mode is the annotation's first, as istio-cni's. `capture status` shows each
//! pod's settings with their source and what a less specific source said that it overrides.

use serde::{Deserialize, Serialize};

use super::{
    mesh_config::{DNS_CAPTURE, INVALID_DROP},
    policy::{ANN_PROXY_GID, ANN_PROXY_UID},
    proxy_config::{parse_switch, ProxyConfigAnnotation},
    proxy_container::{env_switch, INTERCEPTION_MODE_ENV},
    values::{bad, parse_ids},
    ConfigError, DnsCapture, InterceptionMode, PodSpec, ANN_INTERCEPTION_MODE, ANN_PROXY_CONFIG,
    DEFAULT_PROXY_ID, DNS_PORT,
};

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Source {
    Annotation,
    /// The proxy container's environment.
    ProxyEnv,
    /// The proxy container's security context (`runAsUser`, `runAsGroup`).
    ProxySecurityContext,
    Mesh,
    Flag,
    Default,
}

impl Source {
    #[must_use]
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Annotation => "annotation",
            Self::ProxyEnv => "proxy env",
            Self::ProxySecurityContext => "proxy securityContext",
            Self::Mesh => "mesh config",
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

/// The most specific candidate's value. Every annotation's and proxy container's value is
/// checked, even one that loses, so that a pod's acceptance never depends on the mesh or the
/// flags.
fn resolve<T: PartialEq>(
    name: &str,
    candidates: Vec<Candidate>,
    default: (T, &str),
    parse: impl Fn(&Candidate) -> Result<T, ConfigError>,
) -> Result<(T, Setting), ConfigError> {
    let pods_own = [
        Source::Annotation,
        Source::ProxyEnv,
        Source::ProxySecurityContext,
    ];
    for c in candidates.iter().filter(|c| pods_own.contains(&c.source)) {
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
    pub ids: ProxyIds,
    pub settings: Vec<Setting>,
}

/// The proxy's ids: the owners whose connections are exempt.
pub(super) struct ProxyIds {
    pub uids: Vec<u32>,
    pub gids: Vec<u32>,
}

fn id_list(ids: &[u32]) -> String {
    ids.iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// The proxy's uids and gids: the pod's own annotations (where the policy allowed them), the
/// proxy container's `runAsUser`/`runAsGroup` as istio-cni reads them, the node's flags, 1337.
fn resolve_ids(spec: &PodSpec) -> Result<(ProxyIds, Vec<Setting>), ConfigError> {
    let ann = |key: &str| spec.annotations.get(key);
    let container = spec.proxy_container.as_ref();
    let list = |c: &Candidate| match c.source {
        Source::Annotation => parse_ids(&c.from, &c.raw),
        _ => Ok(c
            .raw
            .split(',')
            .filter_map(|id| id.trim().parse().ok())
            .collect()),
    };
    let mut uids = Vec::new();
    if let Some(v) = ann(ANN_PROXY_UID) {
        uids.push(Candidate::new(Source::Annotation, ANN_PROXY_UID, v));
    }
    if let Some((c, Some(uid))) = container.map(|c| c.uid().map(|u| (c, u))).transpose()? {
        uids.push(Candidate::new(
            Source::ProxySecurityContext,
            format!("{} runAsUser", c.name),
            uid.to_string(),
        ));
    }
    if !spec.proxy_uids.is_empty() {
        uids.push(Candidate::new(
            Source::Flag,
            "--proxy-uid",
            id_list(&spec.proxy_uids),
        ));
    }
    let default_id = DEFAULT_PROXY_ID.to_string();
    let (uid_list, uid_setting) = resolve(
        "proxy_uids",
        uids,
        (vec![DEFAULT_PROXY_ID], &default_id),
        list,
    )?;

    let mut gids = Vec::new();
    if let Some(v) = ann(ANN_PROXY_GID) {
        gids.push(Candidate::new(Source::Annotation, ANN_PROXY_GID, v));
    }
    if let Some(v) = ann(ANN_PROXY_UID) {
        // The pod named its proxy uid: the gid is the same unless it names one too.
        gids.push(Candidate::new(Source::Annotation, ANN_PROXY_UID, v));
    }
    if let Some(c) = container {
        // istio-cni: runAsGroup, else 1337 (not the uid).
        let from = match c.run_as_group {
            Some(g) if g != 0 => format!("{} runAsGroup", c.name),
            _ => format!("{} runAsGroup unset", c.name),
        };
        gids.push(Candidate::new(
            Source::ProxySecurityContext,
            from,
            c.gid()?.to_string(),
        ));
    }
    if !spec.proxy_gids.is_empty() {
        gids.push(Candidate::new(
            Source::Flag,
            "--proxy-gid",
            id_list(&spec.proxy_gids),
        ));
    }
    let uid_shown = id_list(&uid_list);
    let (gid_list, gid_setting) = resolve(
        "proxy_gids",
        gids,
        // As istio-iptables' -g: the uids.
        (uid_list.clone(), &uid_shown),
        list,
    )?;
    Ok((
        ProxyIds {
            uids: uid_list,
            gids: gid_list,
        },
        vec![uid_setting, gid_setting],
    ))
}

/// Where a setting read from the pod's proxy-config annotation came from.
fn from_proxy_config(field: &str) -> String {
    format!("{ANN_PROXY_CONFIG} {field}")
}

/// Where a setting read from the pod's mesh configuration came from: its ConfigMap, where known.
fn from_mesh(spec: &PodSpec, field: &str) -> String {
    match &spec.mesh_source {
        Some(source) => format!("{source} {field}"),
        None => field.to_string(),
    }
}

/// The pod's interception mode, from the first of: its annotation, its proxy container's env,
/// its proxy-config annotation, its revision's mesh configuration.
fn resolve_interception_mode(
    spec: &PodSpec,
    proxy_config: Option<&(&String, ProxyConfigAnnotation)>,
) -> Result<(InterceptionMode, Setting), ConfigError> {
    let mesh = spec.mesh_config.as_ref();
    let container = spec.proxy_container.as_ref();
    let mut modes = Vec::new();
    if let Some(v) = spec.annotations.get(ANN_INTERCEPTION_MODE) {
        modes.push(Candidate::new(Source::Annotation, ANN_INTERCEPTION_MODE, v));
    }
    if let Some((c, v)) = container.and_then(|c| Some((c, c.env.get(INTERCEPTION_MODE_ENV)?))) {
        modes.push(Candidate::new(
            Source::ProxyEnv,
            c.env_source(INTERCEPTION_MODE_ENV),
            v,
        ));
    }
    if let Some(v) = proxy_config.and_then(|(_, p)| p.interception_mode.as_ref()) {
        modes.push(Candidate::new(
            Source::Annotation,
            from_proxy_config("interceptionMode"),
            v,
        ));
    }
    if let Some(v) = mesh.and_then(|m| m.interception_mode.as_ref()) {
        modes.push(Candidate::new(
            Source::Mesh,
            from_mesh(spec, "defaultConfig.interceptionMode"),
            v,
        ));
    }
    resolve(
        "interception_mode",
        modes,
        (InterceptionMode::Redirect, "REDIRECT"),
        |c| {
            match c.raw.trim() {
            "REDIRECT" => Ok(InterceptionMode::Redirect),
            "TPROXY" => Ok(InterceptionMode::Tproxy),
            _ => Err(match (c.source, proxy_config) {
                (Source::Annotation, Some((text, _))) if c.from != ANN_INTERCEPTION_MODE => bad(
                    ANN_PROXY_CONFIG,
                    text,
                    format!("interceptionMode={:?}: must be REDIRECT or TPROXY", c.raw),
                ),
                (Source::Annotation, _) => {
                    bad(ANN_INTERCEPTION_MODE, &c.raw, "must be REDIRECT or TPROXY")
                }
                (Source::ProxyEnv, _) => ConfigError::ProxyContainer(format!(
                    "{}={:?}: capture captures REDIRECT or TPROXY (istio-cni refuses the other modes too)",
                    c.from, c.raw
                )),
                _ => ConfigError::Mesh(format!(
                    "{}={:?}: capture supports REDIRECT or TPROXY (istio-cni refuses the other modes too)",
                    c.from, c.raw
                )),
            }),
        }
        },
    )
}

pub(super) fn resolve_pod(spec: &PodSpec) -> Result<Resolved, ConfigError> {
    let proxy_config = match spec.annotations.get(ANN_PROXY_CONFIG) {
        Some(text) => Some((text, ProxyConfigAnnotation::parse(text)?)),
        None => None,
    };
    let mesh = spec.mesh_config.as_ref();
    let container = spec.proxy_container.as_ref();

    let (interception_mode, mode_setting) = resolve_interception_mode(spec, proxy_config.as_ref())?;

    let switch = |key: &'static str, flag: (&str, bool)| {
        let mut candidates = Vec::new();
        if let Some(c) = container {
            // The injector wrote the merged ProxyConfig here: unset is off (istio-cni).
            let raw = c.env.get(key).map_or("false", String::as_str);
            candidates.push(Candidate::new(Source::ProxyEnv, c.env_source(key), raw));
        }
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
                from_mesh(spec, &format!("defaultConfig.proxyMetadata.{key}")),
                on.to_string(),
            ));
        }
        // A flag can only turn a switch on: off is its absence.
        if flag.1 {
            candidates.push(Candidate::new(Source::Flag, flag.0, "true"));
        }
        candidates
    };
    let parse_switch_of = |c: &Candidate| match c.source {
        Source::ProxyEnv => env_switch(&c.from, &c.raw),
        _ => parse_switch(&c.raw).ok_or_else(|| {
            let text = proxy_config.as_ref().map_or("", |(t, _)| t.as_str());
            bad(
                ANN_PROXY_CONFIG,
                text,
                format!("{}={:?} is not true or false", c.from, c.raw),
            )
        }),
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
    let (ids, id_settings) = resolve_ids(spec)?;

    // On, without capture-all and without nameservers, DNS capture is off (as Istio's).
    let dns =
        (dns_on && (spec.mesh.capture_all_dns || !spec.mesh.nameservers.is_empty())).then(|| {
            DnsCapture {
                capture_all: spec.mesh.capture_all_dns,
                nameservers: spec.mesh.nameservers.clone(),
                port: DNS_PORT,
            }
        });
    let mut settings = vec![mode_setting, dns_setting, drop_setting];
    settings.extend(id_settings);
    Ok(Resolved {
        interception_mode,
        dns,
        drop_invalid,
        ids,
        settings,
    })
}
