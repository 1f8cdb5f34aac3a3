//! `capture install-cni` / `uninstall-cni`: put the capture-cni binary in the node's CNI bin
//! directory and chain it at the end of the node's active network configuration, keeping the
//! file's other plugins, key order and indentation; and take both out again. Both are idempotent.
//! Beside istio-cni only when told to replace it (istio.rs).

pub mod chain_report;
pub mod istio;

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde_json::{json, Map, Value};

use crate::paths::DEFAULT_STATE_DIR;

pub const PLUGIN_TYPE: &str = "capture-cni";

#[derive(Debug, thiserror::Error)]
pub enum InstallError {
    #[error("no CNI network configuration (*.conf, *.conflist, *.json) in {0}; install capture after the cluster's network plugin has written its configuration")]
    NoConfig(PathBuf),
    #[error("{path} is not a CNI network configuration: {reason}")]
    BadConfig { path: PathBuf, reason: String },
    #[error("{path}: {source}")]
    Io { path: PathBuf, source: io::Error },
    #[error("{path} chains istio-cni, which writes Istio's own rules into the pods capture would capture: remove Istio's CNI from this node, or run install-cni with --replace-istio-cni to take its place (uninstall-cni puts it back)")]
    IstioCniChained { path: PathBuf },
    #[error("{path} chains istio-cni with ambient_enabled: it enrols ambient pods in ztunnel, which capture does not do, and it captures sidecar pods too; capture cannot replace it on this node: keep capture to nodes without ambient workloads and take istio-cni off them (docs/using/istio-migration.md, \"Ambient\")")]
    IstioCniServesAmbient { path: PathBuf },
}

fn io_err(path: &Path) -> impl FnOnce(io::Error) -> InstallError + '_ {
    move |source| InstallError::Io {
        path: path.into(),
        source,
    }
}

/// The conflist entry capture adds. `state_dir` is written only when it is not the default: the
/// plugin reads the agent's claims there to answer DEL while the agent is down.
#[must_use]
pub fn plugin_entry(agent_socket: &Path, state_dir: Option<&Path>) -> Value {
    let mut entry = json!({
        "type": PLUGIN_TYPE,
        "agent_socket": agent_socket,
        "capabilities": { "io.kubernetes.cri.pod-annotations": true },
    });
    if let Some(dir) = state_dir.filter(|d| *d != Path::new(DEFAULT_STATE_DIR)) {
        entry["state_dir"] = json!(dir);
    }
    entry
}

/// The indentation a file uses, so that a rewrite looks like the original.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Indent(String);

fn detect_indent(text: &str) -> Indent {
    let unit = text
        .lines()
        .skip(1)
        .find_map(|l| {
            let ws: String = l.chars().take_while(|c| *c == ' ' || *c == '\t').collect();
            (!ws.is_empty()).then_some(ws)
        })
        .unwrap_or_else(|| "  ".into());
    // A tab-indented file indents with one tab; a space-indented one with its first level.
    Indent(if unit.starts_with('\t') {
        "\t".into()
    } else {
        unit
    })
}

fn render(value: &Value, indent: &Indent, trailing_newline: bool) -> String {
    let mut out = Vec::new();
    let fmt = serde_json::ser::PrettyFormatter::with_indent(indent.0.as_bytes());
    let mut ser = serde_json::Serializer::with_formatter(&mut out, fmt);
    serde::Serialize::serialize(value, &mut ser).expect("JSON values serialise");
    let mut s = String::from_utf8(out).expect("serde_json writes UTF-8");
    if trailing_newline {
        s.push('\n');
    }
    s
}

fn parse(path: &Path, text: &str) -> Result<Map<String, Value>, InstallError> {
    let bad = |reason: String| InstallError::BadConfig {
        path: path.into(),
        reason,
    };
    match serde_json::from_str::<Value>(text).map_err(|e| bad(e.to_string()))? {
        Value::Object(m) => Ok(m),
        _ => Err(bad("not a JSON object".into())),
    }
}

/// A single-plugin `.conf` as a conflist: the same network with the plugin as its first entry.
fn as_conflist(mut conf: Map<String, Value>) -> Map<String, Value> {
    if conf.contains_key("plugins") {
        return conf;
    }
    let mut list = Map::new();
    for key in ["cniVersion", "name"] {
        if let Some(v) = conf.get(key) {
            list.insert(key.into(), v.clone());
        }
    }
    conf.remove("cniVersion");
    list.insert("plugins".into(), Value::Array(vec![Value::Object(conf)]));
    list
}

fn is_capture(v: &Value) -> bool {
    v.get("type").and_then(Value::as_str) == Some(PLUGIN_TYPE)
}

/// The configuration text with `entry` (capture-cni's) chained last (updated in place if
/// present). Where istio-cni is chained, refused, or with its entry taken out when
/// `replace_istio_cni`: the text, and the entry taken out with its place.
pub fn chain_text(
    path: &Path,
    text: &str,
    entry: &Value,
    replace_istio_cni: bool,
) -> Result<(String, Option<(usize, Value)>), InstallError> {
    let mut list = as_conflist(parse(path, text)?);
    let plugins = list
        .get_mut("plugins")
        .and_then(Value::as_array_mut)
        .ok_or_else(|| InstallError::BadConfig {
            path: path.into(),
            reason: "\"plugins\" is not a list".into(),
        })?;
    if plugins.is_empty() {
        return Err(InstallError::BadConfig {
            path: path.into(),
            reason: "the plugin list is empty".into(),
        });
    }
    let mut replaced = None;
    if let Some(at) = plugins.iter().position(istio::is_istio_cni) {
        if plugins.iter().any(istio::serves_ambient) {
            return Err(InstallError::IstioCniServesAmbient { path: path.into() });
        }
        if !replace_istio_cni {
            return Err(InstallError::IstioCniChained { path: path.into() });
        }
        replaced = Some((at, plugins.remove(at)));
        plugins.retain(|p| !istio::is_istio_cni(p));
    }
    plugins.retain(|p| !is_capture(p));
    plugins.push(entry.clone());
    Ok((
        render(
            &Value::Object(list),
            &detect_indent(text),
            text.ends_with('\n'),
        ),
        replaced,
    ))
}

/// The configuration text with a replaced istio-cni entry back in place, or `None` when there
/// is nothing to put back.
pub fn restore_into(
    path: &Path,
    text: &str,
    replaced: &istio::Replaced,
) -> Result<Option<String>, InstallError> {
    let mut list = parse(path, text)?;
    let Some(plugins) = list.get_mut("plugins").and_then(Value::as_array_mut) else {
        return Ok(None);
    };
    if !istio::put_back(plugins, replaced) {
        return Ok(None);
    }
    Ok(Some(render(
        &Value::Object(list),
        &detect_indent(text),
        text.ends_with('\n'),
    )))
}

/// The configuration text without capture-cni, or `None` when it has no capture entry.
pub fn remove_from(path: &Path, text: &str) -> Result<Option<String>, InstallError> {
    let mut list = parse(path, text)?;
    let Some(plugins) = list.get_mut("plugins").and_then(Value::as_array_mut) else {
        return Ok(None);
    };
    let before = plugins.len();
    plugins.retain(|p| !is_capture(p));
    if plugins.len() == before {
        return Ok(None);
    }
    Ok(Some(render(
        &Value::Object(list),
        &detect_indent(text),
        text.ends_with('\n'),
    )))
}

fn is_config_name(name: &str) -> bool {
    !name.starts_with('.')
        && [".conf", ".conflist", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext))
}

/// The configuration the runtime uses: the first by name, as containerd and CRI-O pick it.
pub fn active_config(conf_dir: &Path) -> Result<PathBuf, InstallError> {
    let mut names: Vec<String> = fs::read_dir(conf_dir)
        .map_err(io_err(conf_dir))?
        .flatten()
        .filter(|e| e.file_type().is_ok_and(|t| t.is_file()))
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| is_config_name(n))
        .collect();
    names.sort();
    names
        .first()
        .map(|n| conf_dir.join(n))
        .ok_or_else(|| InstallError::NoConfig(conf_dir.into()))
}

/// The keys of the capture-cni entry chained in `conf_dir`'s active configuration, as the plugin
/// reads them at ADD (its defaults where the entry sets none); none when capture is not chained
/// there.
///
/// # Errors
/// The configuration cannot be read, is no JSON, or the entry's keys are not the plugin's.
pub fn chained_plugin_config(
    conf_dir: &Path,
) -> Result<Option<crate::cni::PluginConfig>, InstallError> {
    let path = active_config(conf_dir)?;
    let text = fs::read_to_string(&path).map_err(io_err(&path))?;
    let bad = |reason: String| InstallError::BadConfig {
        path: path.clone(),
        reason,
    };
    let config: Value = serde_json::from_str(&text).map_err(|e| bad(e.to_string()))?;
    let Some(entry) = config["plugins"]
        .as_array()
        .and_then(|plugins| plugins.iter().find(|p| p["type"] == PLUGIN_TYPE))
    else {
        return Ok(None);
    };
    let mut keys = entry.as_object().cloned().unwrap_or_default();
    // The keys CNI itself defines; the rest are the plugin's.
    for standard in [
        "type",
        "name",
        "cniVersion",
        "capabilities",
        "runtimeConfig",
        "args",
    ] {
        keys.remove(standard);
    }
    serde_json::from_value(Value::Object(keys))
        .map(Some)
        .map_err(|e| bad(format!("its {PLUGIN_TYPE} entry: {e}")))
}

fn write_atomic(path: &Path, data: &[u8], mode: u32) -> Result<(), InstallError> {
    crate::fsutil::write_atomic(path, data, Some(mode)).map_err(io_err(path))
}

pub struct InstallOptions {
    pub cni_bin_dir: PathBuf,
    pub cni_conf_dir: PathBuf,
    /// A specific configuration file instead of the active one.
    pub conf_file: Option<PathBuf>,
    pub plugin_binary: PathBuf,
    pub agent_socket: PathBuf,
    /// The agent's state directory, written into the entry when it is not the default.
    pub state_dir: Option<PathBuf>,
    /// Take istio-cni's place in the chain (it is kept, and put back by `uninstall`).
    pub replace_istio_cni: bool,
}

/// What `install` changed.
#[derive(Debug, PartialEq, Eq)]
pub struct Installed {
    pub config: PathBuf,
    pub config_changed: bool,
    pub binary_changed: bool,
    /// istio-cni's entry was taken out of the chain (and kept: `istio::saved_path`).
    pub replaced_istio_cni: bool,
}

/// What `chain` did to the active configuration.
#[derive(Debug, PartialEq, Eq)]
pub struct Chained {
    pub config: PathBuf,
    pub changed: bool,
    pub replaced_istio_cni: bool,
}

pub fn install(opts: &InstallOptions) -> Result<Installed, InstallError> {
    // Refused before anything is written: a configuration that does not parse, istio-cni
    // chained without --replace-istio-cni.
    plan(opts)?;
    let binary = fs::read(&opts.plugin_binary).map_err(io_err(&opts.plugin_binary))?;
    let target = opts.cni_bin_dir.join(PLUGIN_TYPE);
    let binary_changed = fs::read(&target).map_or(true, |old| old != binary);
    if binary_changed {
        fs::create_dir_all(&opts.cni_bin_dir).map_err(io_err(&opts.cni_bin_dir))?;
        write_atomic(&target, &binary, 0o755)?;
    }
    let chained = chain(opts)?;
    Ok(Installed {
        config: chained.config,
        config_changed: chained.changed,
        binary_changed,
        replaced_istio_cni: chained.replaced_istio_cni,
    })
}

/// What chaining would write.
struct Plan {
    source: PathBuf,
    text: String,
    updated: String,
    /// istio-cni's entry taken out, and its place.
    replaced: Option<(usize, Value)>,
}

fn plan(opts: &InstallOptions) -> Result<Plan, InstallError> {
    let source = match &opts.conf_file {
        Some(f) => f.clone(),
        None => active_config(&opts.cni_conf_dir)?,
    };
    let text = fs::read_to_string(&source).map_err(io_err(&source))?;
    let entry = plugin_entry(&opts.agent_socket, opts.state_dir.as_deref());
    let conf_dir = source.parent().unwrap_or(&opts.cni_conf_dir);
    // A node that chose capture over istio-cni keeps that choice until uninstall-cni.
    let replace = opts.replace_istio_cni || istio::load(conf_dir)?.is_some();
    let (updated, replaced) = chain_text(&source, &text, &entry, replace)?;
    Ok(Plan {
        source,
        text,
        updated,
        replaced,
    })
}

/// Chains capture-cni last in the active configuration (or `conf_file`). A single-plugin .conf
/// becomes a .conflist of the same name.
pub fn chain(opts: &InstallOptions) -> Result<Chained, InstallError> {
    let Plan {
        source,
        text,
        updated,
        replaced,
    } = plan(opts)?;
    let conf_dir = source.parent().unwrap_or(&opts.cni_conf_dir);
    let config = if source.extension().is_some_and(|e| e == "conf") {
        source.with_extension("conflist")
    } else {
        source.clone()
    };
    let replaced_istio_cni = replaced.is_some();
    if let Some((index, entry)) = replaced {
        let config_name = config
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        istio::save(
            conf_dir,
            &istio::Replaced {
                config: config_name,
                index,
                entry,
            },
        )?;
    }
    let changed = updated != text || config != source;
    if changed {
        write_atomic(&config, updated.as_bytes(), 0o644)?;
        if config != source {
            fs::remove_file(&source).map_err(io_err(&source))?;
        }
    }
    Ok(Chained {
        config,
        changed,
        replaced_istio_cni,
    })
}

/// Whether capture-cni is installed in the bin directory (`uninstall` removes it).
#[must_use]
pub fn plugin_installed(cni_bin_dir: &Path) -> bool {
    cni_bin_dir.join(PLUGIN_TYPE).is_file()
}

/// Removes capture-cni's binary, then capture-cni from every configuration in the directory.
/// The binary goes first: the agent's CNI watcher chains capture-cni only while it is there.
pub fn uninstall(opts: &InstallOptions) -> Result<Vec<PathBuf>, InstallError> {
    let binary = opts.cni_bin_dir.join(PLUGIN_TYPE);
    match fs::remove_file(&binary) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => {
            return Err(InstallError::Io {
                path: binary,
                source: e,
            })
        }
        _ => {}
    }
    let conf_dir = &opts.cni_conf_dir;
    let replaced = istio::load(conf_dir)?;
    // istio-cni goes back in the same write that takes capture-cni out: no pod is set up by
    // neither.
    let restore_in = match &replaced {
        Some(r) if conf_dir.join(&r.config).is_file() => Some(conf_dir.join(&r.config)),
        Some(_) => Some(active_config(conf_dir)?),
        None => None,
    };
    let mut changed = Vec::new();
    let entries = fs::read_dir(conf_dir).map_err(io_err(conf_dir))?;
    for e in entries.flatten() {
        let path = e.path();
        if !is_config_name(&e.file_name().to_string_lossy()) {
            continue;
        }
        let text = fs::read_to_string(&path).map_err(io_err(&path))?;
        let mut updated = remove_from(&path, &text)?;
        if let Some(r) = replaced
            .as_ref()
            .filter(|_| restore_in.as_ref() == Some(&path))
        {
            let base = updated.as_deref().unwrap_or(&text);
            if let Some(restored) = restore_into(&path, base, r)? {
                updated = Some(restored);
            }
        }
        if let Some(updated) = updated {
            write_atomic(&path, updated.as_bytes(), 0o644)?;
            changed.push(path);
        }
    }
    if replaced.is_some() {
        istio::forget(conf_dir)?;
    }
    Ok(changed)
}

/// Takes capture-cni out of one configuration file; whether it was there.
pub fn unchain(path: &Path) -> Result<bool, InstallError> {
    let text = fs::read_to_string(path).map_err(io_err(path))?;
    let Some(updated) = remove_from(path, &text)? else {
        return Ok(false);
    };
    write_atomic(path, updated.as_bytes(), 0o644)?;
    Ok(true)
}

#[cfg(test)]
#[path = "tests.rs"]
mod tests;
