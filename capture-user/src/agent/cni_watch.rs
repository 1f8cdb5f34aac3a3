//! Keeps capture-cni chained in the node's active CNI configuration.
//!
//! Primary network plugins (Calico, Cilium and others) rewrite or replace their configuration
//! when they restart or upgrade, and drop the entries they do not know; new meshed pods would
//! then start without capture, and nothing would say so. The agent looks at the configuration
//! directory four times a second (a listing and each file's size and modification time, cheap
//! enough to leave running, and unlike inotify indifferent to how the directory is mounted) and
//! chains capture-cni again within a second of such a change. `capture uninstall-cni` stays the
//! only way out: it removes the plugin binary, and the watcher chains only while that is there.

use std::{
    fs, io,
    os::unix::fs::MetadataExt,
    path::PathBuf,
    thread,
    time::{Duration, SystemTime},
};

use prometheus_client::metrics::counter::Counter;
use tracing::{info, warn};

use crate::install::{self, InstallError, InstallOptions};

const PERIOD: Duration = Duration::from_millis(250);

/// What the watcher keeps chained, and where.
#[derive(Clone, Debug)]
pub struct CniWatch {
    pub conf_dir: PathBuf,
    pub bin_dir: PathBuf,
    /// The agent socket the chained entry names.
    pub agent_socket: PathBuf,
    /// The agent's state directory, which the entry names where it is not the default.
    pub state_dir: PathBuf,
}

/// Each entry's name, inode, size and modification time, sorted by name (a file renamed over
/// another is a new inode even where timestamps are coarse).
type Fingerprint = Vec<(String, u64, u64, Option<SystemTime>)>;

impl CniWatch {
    fn fingerprint(&self) -> Fingerprint {
        let mut entries: Fingerprint = fs::read_dir(&self.conf_dir)
            .map(|dir| {
                dir.filter_map(Result::ok)
                    .map(|e| {
                        let meta = e.metadata().ok();
                        (
                            e.file_name().to_string_lossy().into_owned(),
                            meta.as_ref().map_or(0, MetadataExt::ino),
                            meta.as_ref().map_or(0, fs::Metadata::len),
                            meta.and_then(|m| m.modified().ok()),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        entries.sort();
        entries
    }

    /// Chains capture-cni if the active configuration lacks it (and the plugin is installed);
    /// returns the file it rewrote.
    pub fn ensure_chained(&self) -> Result<Option<PathBuf>, InstallError> {
        if !install::plugin_installed(&self.bin_dir) {
            return Ok(None);
        }
        let opts = InstallOptions {
            cni_bin_dir: self.bin_dir.clone(),
            cni_conf_dir: self.conf_dir.clone(),
            conf_file: None,
            plugin_binary: PathBuf::new(),
            agent_socket: self.agent_socket.clone(),
            state_dir: Some(self.state_dir.clone()),
            // Only an operator replaces istio-cni; a node that did stays so (install/istio.rs).
            replace_istio_cni: false,
        };
        let install::Chained {
            config,
            changed,
            replaced_istio_cni,
        } = install::chain(&opts)?;
        if replaced_istio_cni {
            warn!(config = %config.display(), "istio-cni was chained again on a node that replaced it; replaced it again (its newest entry is kept for uninstall-cni)");
        }
        // uninstall-cni removes the binary before it edits the configuration: one that went
        // while this check ran means the entry just written must go again.
        if changed && !install::plugin_installed(&self.bin_dir) {
            install::unchain(&config)?;
            return Ok(None);
        }
        Ok(changed.then_some(config))
    }

    /// Watches until the process ends, counting each re-chaining in `rechained`.
    pub fn spawn(self, rechained: Counter) -> io::Result<thread::JoinHandle<()>> {
        thread::Builder::new()
            .name("cni-watch".into())
            .spawn(move || self.run(&rechained))
    }

    fn run(&self, rechained: &Counter) {
        info!(conf_dir = %self.conf_dir.display(), "keeping capture-cni chained");
        let mut seen: Option<Fingerprint> = None;
        let mut last_error: Option<String> = None;
        loop {
            let now = self.fingerprint();
            if seen.as_ref() != Some(&now) {
                // `now` was taken before the check, so a change made while it ran is seen on
                // the next period rather than taken for one already handled.
                match self.ensure_chained() {
                    Ok(None) => {
                        last_error = None;
                        seen = Some(now);
                    }
                    Ok(Some(config)) => {
                        last_error = None;
                        rechained.inc();
                        warn!(config = %config.display(), "capture-cni had been dropped from the active CNI configuration; chained it again");
                        // Our own write changed the directory: check once more next period.
                        seen = None;
                    }
                    Err(e) => {
                        // A file half-written by its owner, or none yet: retried on every
                        // period until it parses, said once.
                        let text = e.to_string();
                        if last_error.as_deref() != Some(&text) {
                            warn!(error = %text, "cannot chain capture-cni yet");
                            last_error = Some(text);
                        }
                        seen = None;
                    }
                }
            }
            thread::sleep(PERIOD);
        }
    }
}
