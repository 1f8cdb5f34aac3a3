//! A captured pod brought to its proxy container's settings, in place.
//!
//! At ADD capture knows a pod's annotations and its revision's mesh configuration; istio-cni
//! knows its proxy container too (through the API server): the environment the injector filled
//! from the merged ProxyConfig and the container's `runAsUser`/`runAsGroup`. capture learns that
//! container from the runtime as soon as it is created (`agent::proxy_watch`), before its process
//! runs, and brings the pod's capture to what it says here: the ebpf backend rewrites the pod's
//! map entries, the rule backends their rules. A setting of the container that cannot be read is
//! refused, naming it: the pod keeps what ADD set up, and `capture status` says why.

use crate::{
    any_backend::{AnyBackend, BackendError},
    backend::OpenedPod,
    config::{CaptureConfig, PodSpec, ProxyContainerConfig},
    ebpf::EbpfBackend,
    netns::Netns,
    ops::{self, Error},
    paths::Paths,
    record::{self, Mode, PodRecord, PodSelector},
};

/// What became of a pod when its proxy container was learned.
#[derive(Debug, PartialEq, Eq)]
pub enum Applied {
    /// Its capture already was what the container says.
    Unchanged,
    /// Its capture was rewritten: the settings that changed, in words.
    Updated(Vec<String>),
    /// A setting of the container cannot be applied: the pod keeps ADD's, for this reason.
    Refused(String),
}

/// The pod spec a recorded pod was set up from, as the caller knows it now (its revision's mesh
/// configuration, the node's flags); the proxy container is added to it here.
pub type SpecOf<'a> = &'a dyn Fn(&PodRecord) -> Result<PodSpec, String>;

/// Brings the selected pod's capture to its proxy container's settings.
///
/// # Errors
/// The pod is not captured, its netns is gone, or its backend cannot be rewritten (the pod then
/// keeps ADD's capture where it could be restored).
pub fn apply(
    paths: &Paths,
    which: &PodSelector,
    proxy: &ProxyContainerConfig,
    spec_of: SpecOf<'_>,
) -> Result<Applied, Error> {
    let _lock = ops::lock(paths)?;
    let Some(mut record) = record::find(paths, which, crate::ebpf::netns_cookie::netns_cookie)?
    else {
        return Err(Error::Identity(format!(
            "{which:?} is not captured (no record in the state directory)"
        )));
    };
    let spec = match spec_of(&record) {
        Ok(spec) => PodSpec {
            proxy_container: Some(proxy.clone()),
            ..spec
        },
        Err(why) => return refuse(paths, record, proxy, why),
    };
    let (mut config, settings) = match CaptureConfig::from_pod_with_settings(&spec) {
        Ok(resolved) => resolved,
        Err(e) => return refuse(paths, record, proxy, e.to_string()),
    };
    let old = record.config.clone();
    // What attach decided beside the settings stays as attach decided it.
    config.proxy_identity.clone_from(&old.proxy_identity);
    config.accelerate = old.accelerate;
    config.spare_open_connections = old.spare_open_connections;
    config.stateless_redirect6 = old.stateless_redirect6;
    let netns = Netns::open(&record.netns)?;
    config.host_ids = crate::userns::host_ids(netns.file(), &config.pod_ids())?;
    if let Some(gap) = config
        .ebpf_unsupported()
        .filter(|_| record.mode == Mode::Ebpf)
    {
        let why = format!(
            "the proxy container asks for what the ebpf backend does not serve ({gap}); the pod keeps its capture: recreate it to move it to the fallback backend"
        );
        return refuse(paths, record, proxy, why);
    }
    let changed = differences(&old, &config);
    if changed.is_empty() {
        // An agent's restart learns every proxy again: a pod that says the same is not written.
        let learned = (Some(proxy), None, &settings);
        let recorded = (
            record.proxy_container.as_ref(),
            record.proxy_settings_refused.as_ref(),
            &record.settings,
        );
        if learned != recorded {
            record.settings = settings;
            record.proxy_container = Some(proxy.clone());
            record.proxy_settings_refused = None;
            record::save(paths, &record)?;
        }
        return Ok(Applied::Unchanged);
    }
    record.settings = settings;
    record.proxy_container = Some(proxy.clone());
    record.proxy_settings_refused = None;
    rewrite(paths, &record, &old, &config)?;
    record.config = config;
    record::save(paths, &record)?;
    Ok(Applied::Updated(changed))
}

/// Keeps the pod as ADD set it up, saying why in its record.
fn refuse(
    paths: &Paths,
    mut record: PodRecord,
    proxy: &ProxyContainerConfig,
    why: String,
) -> Result<Applied, Error> {
    record.proxy_container = Some(proxy.clone());
    record.proxy_settings_refused = Some(why.clone());
    record::save(paths, &record)?;
    Ok(Applied::Refused(why))
}

/// The pod's backend rewritten from `old` to `new`: the ebpf maps in place; the rules removed and
/// written again (before the app's containers run), or put back as they were where the new ones
/// are refused.
fn rewrite(
    paths: &Paths,
    record: &PodRecord,
    old: &CaptureConfig,
    new: &CaptureConfig,
) -> Result<(), Error> {
    let backend_err = |e: BackendError| Error::Backend(e);
    if record.mode == Mode::Ebpf {
        let mut ebpf = EbpfBackend::adopt(paths).map_err(|e| backend_err(e.into()))?;
        return ebpf
            .reconfigure_from(record.netns_cookie, old, new)
            .map_err(|e| backend_err(e.into()));
    }
    let mut backend = AnyBackend::of_record(paths, record)?;
    backend.detach(record)?;
    let opened = OpenedPod::of(record)?;
    if let Err(e) = backend.attach(&opened.target(), new) {
        if let Err(back) = backend.attach(&opened.target(), old) {
            tracing::error!(netns = %record.netns.display(), error = %back, "the pod's rules could not be put back: it is not captured");
        }
        return Err(e.into());
    }
    Ok(())
}

/// The settings a proxy container can decide, where `old` and `new` differ, in words.
fn differences(old: &CaptureConfig, new: &CaptureConfig) -> Vec<String> {
    let mut changed = Vec::new();
    let mut note = |name: &str, a: String, b: String| {
        if a != b {
            changed.push(format!("{name} {a} -> {b}"));
        }
    };
    note(
        "interception_mode",
        format!("{:?}", old.interception_mode),
        format!("{:?}", new.interception_mode),
    );
    note(
        "dns_capture",
        old.dns.is_some().to_string(),
        new.dns.is_some().to_string(),
    );
    note(
        "drop_invalid",
        old.drop_invalid.to_string(),
        new.drop_invalid.to_string(),
    );
    note(
        "proxy_uids",
        format!("{:?}", old.proxy_uids),
        format!("{:?}", new.proxy_uids),
    );
    note(
        "proxy_gids",
        format!("{:?}", old.proxy_gids),
        format!("{:?}", new.proxy_gids),
    );
    if changed.is_empty() && old != new {
        changed.push("configuration".into());
    }
    changed
}
