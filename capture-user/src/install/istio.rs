//! istio-cni in the node's chain. Istio's install-cni chains an entry of type `istio-cni`
//! (`cni/pkg/install/cniconfig.go` in istio/istio) that writes Istio's iptables rules into every
//! pod it selects; capture-cni beside it would capture the same pods a second time. So
//! `install-cni` refuses to chain beside it unless told to replace it: then it takes istio-cni's
//! entry out and keeps it, with its place in the chain, in a file of the configuration directory
//! that runtimes do not read (their loaders take `.conf`, `.conflist` and `.json` only), and
//! `uninstall-cni` puts it back where it was. An entry with ambient on is never replaced: it
//! serves ambient pods, which capture does not.
//!
//! While that file exists the node has chosen capture over istio-cni: chaining again (the
//! agent's watcher, a later install-cni) replaces an istio-cni entry that Istio's own DaemonSet
//! wrote back, and keeps the newest.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

use serde::{Deserialize, Serialize};
use serde_json::Value;

use super::{io_err, write_atomic, InstallError};

pub const ISTIO_CNI_TYPE: &str = "istio-cni";
/// Where a replaced istio-cni entry is kept, in the configuration directory.
pub const SAVED_FILE: &str = "capture-replaced-istio-cni.saved";

/// A replaced istio-cni entry and where it was.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Replaced {
    /// The configuration file's name, in the same directory.
    pub config: String,
    /// Its place in that file's plugin list.
    pub index: usize,
    pub entry: Value,
}

pub fn is_istio_cni(plugin: &Value) -> bool {
    plugin.get("type").and_then(Value::as_str) == Some(ISTIO_CNI_TYPE)
}

/// An istio-cni entry of a mesh with ambient on (`ambient_enabled`, `cni/pkg/plugin/plugin.go`'s
/// `Config`, written by Istio's install-cni when `ambient.enabled`): it enrols ambient pods in
/// ztunnel at ADD, which nothing else on the node does, so it cannot be replaced.
pub fn serves_ambient(plugin: &Value) -> bool {
    is_istio_cni(plugin) && plugin.get("ambient_enabled") == Some(&Value::Bool(true))
}

#[must_use]
pub fn saved_path(conf_dir: &Path) -> PathBuf {
    conf_dir.join(SAVED_FILE)
}

/// The replaced entry kept in `conf_dir`, if istio-cni was replaced there.
pub fn load(conf_dir: &Path) -> Result<Option<Replaced>, InstallError> {
    let path = saved_path(conf_dir);
    let text = match fs::read_to_string(&path) {
        Ok(text) => text,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(io_err(&path)(e)),
    };
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| InstallError::BadConfig {
            path: path.clone(),
            reason: format!(
                "{e}: it keeps the istio-cni entry capture replaced; restore that entry by hand from the file, then delete it"
            ),
        })
}

/// Keeps `replaced` in `conf_dir`, before the configuration without it is written: a crash in
/// between leaves both, never neither.
pub fn save(conf_dir: &Path, replaced: &Replaced) -> Result<(), InstallError> {
    let text = serde_json::to_string_pretty(replaced).expect("a JSON value serialises");
    write_atomic(&saved_path(conf_dir), format!("{text}\n").as_bytes(), 0o644)
}

/// Forgets the kept entry once it is back in the chain.
pub fn forget(conf_dir: &Path) -> Result<(), InstallError> {
    let path = saved_path(conf_dir);
    match fs::remove_file(&path) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(io_err(&path)(e)),
        _ => Ok(()),
    }
}

/// `plugins` with `replaced`'s entry back at its place (or last, if the list is shorter now),
/// unless an istio-cni entry is already there.
pub fn put_back(plugins: &mut Vec<Value>, replaced: &Replaced) -> bool {
    if plugins.iter().any(is_istio_cni) {
        return false;
    }
    let at = replaced.index.min(plugins.len());
    plugins.insert(at, replaced.entry.clone());
    true
}
