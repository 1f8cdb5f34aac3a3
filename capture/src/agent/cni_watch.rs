//! Keeps capture-cni chained in the node's active CNI configuration.
//!
//! Primary network plugins (Calico, Cilium and others) rewrite or replace their configuration
//! when they restart or upgrade, and drop the entries they do not know; new meshed pods would
//! then start without capture, and nothing would say so. The agent looks at the configuration
//! directory four times a second (a listing and each file's size and modification time, cheap
//! enough to leave running, and unlike inotify indifferent to how the directory is mounted) and
//! chains capture-cni again within a second of such a change, unless the configuration keeps
//! dropping it: then it waits longer each time and names the fight (`cni_fight`). While
//! capture-cni is not chained the agent is not ready, as istio-cni's node agent is not.
//! `capture uninstall-cni` stays the only way out: it removes the plugin binary, and the watcher
//! chains only while that is there.

use std::{
    fs, io,
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    thread,
    time::{Duration, Instant, SystemTime},
};

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};
use tracing::{info, warn};

use super::cni_fight::{ChainReport, Neighbour, Throttle};
use crate::{
    fsutil::write_atomic,
    install::{self, InstallError, InstallOptions},
    record::now_unix,
};

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

/// The series the watcher keeps.
#[derive(Clone, Default)]
pub struct ChainMetrics {
    /// Each time capture-cni was chained again.
    pub rechained: Counter,
    /// 1 while capture-cni is in the active configuration.
    pub chained: Gauge,
    /// 1 while something keeps taking it out again.
    pub fighting: Gauge,
}

/// The watcher's latest view, shared with the agent's readiness and written for `capture
/// status`.
#[derive(Clone)]
pub struct ChainState {
    report: Arc<Mutex<ChainReport>>,
    path: PathBuf,
}

impl ChainState {
    #[must_use]
    pub fn new(conf_dir: &Path, report_path: PathBuf) -> Self {
        let report = ChainReport {
            conf_dir: conf_dir.to_path_buf(),
            problem: Some("not looked at yet".into()),
            ..ChainReport::default()
        };
        Self {
            report: Arc::new(Mutex::new(report)),
            path: report_path,
        }
    }

    /// Why the node is not ready as far as its CNI configuration goes.
    #[must_use]
    pub fn unready(&self) -> Option<String> {
        let report = self.report.lock().unwrap_or_else(PoisonError::into_inner);
        if report.chained {
            return None;
        }
        let mut why = format!(
            "capture-cni is not chained in {}: {}",
            report.conf_dir.display(),
            report.problem.as_deref().unwrap_or("not looked at yet")
        );
        if let Some(fight) = &report.fight {
            why.push_str(&format!("; {}", fight.fix));
        }
        Some(why)
    }

    fn update(&self, change: impl FnOnce(&mut ChainReport)) {
        let mut report = self.report.lock().unwrap_or_else(PoisonError::into_inner);
        let before = report.clone();
        change(&mut report);
        if *report == before {
            return;
        }
        let data = serde_json::to_vec_pretty(&*report).expect("reports serialise");
        if let Err(e) = write_atomic(&self.path, &data, None) {
            warn!(path = %self.path.display(), error = %e, "cannot write the CNI chain's report for capture status");
        }
    }
}

/// Each entry's name, inode, size and modification time, sorted by name (a file renamed over
/// another is a new inode even where timestamps are coarse).
type Fingerprint = Vec<(String, u64, u64, Option<SystemTime>)>;

/// What one look at the configuration found.
enum Look {
    Chained(PathBuf),
    /// capture-cni is missing from this active configuration.
    Dropped(PathBuf),
    /// The plugin binary is not installed (uninstall-cni ran): nothing is chained.
    NotInstalled,
}

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

    fn options(&self) -> InstallOptions {
        InstallOptions {
            cni_bin_dir: self.bin_dir.clone(),
            cni_conf_dir: self.conf_dir.clone(),
            conf_file: None,
            plugin_binary: PathBuf::new(),
            agent_socket: self.agent_socket.clone(),
            state_dir: Some(self.state_dir.clone()),
            // Only an operator replaces istio-cni; a node that did stays so (install/istio.rs).
            replace_istio_cni: false,
        }
    }

    fn look(&self) -> Result<Look, InstallError> {
        if !install::plugin_installed(&self.bin_dir) {
            return Ok(Look::NotInstalled);
        }
        let active = install::active_config(&self.conf_dir)?;
        Ok(match install::chained_plugin_config(&self.conf_dir)? {
            Some(_) => Look::Chained(active),
            None => Look::Dropped(active),
        })
    }

    /// Chains capture-cni if the active configuration lacks it (and the plugin is installed);
    /// returns the file it rewrote.
    pub fn ensure_chained(&self) -> Result<Option<PathBuf>, InstallError> {
        if !install::plugin_installed(&self.bin_dir) {
            return Ok(None);
        }
        let install::Chained {
            config,
            changed,
            replaced_istio_cni,
        } = install::chain(&self.options())?;
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

    /// Watches until the process ends, keeping `metrics` and `state`.
    pub fn spawn(
        self,
        metrics: ChainMetrics,
        state: ChainState,
    ) -> io::Result<thread::JoinHandle<()>> {
        thread::Builder::new()
            .name("cni-watch".into())
            .spawn(move || self.run(&metrics, &state))
    }

    fn run(&self, metrics: &ChainMetrics, state: &ChainState) {
        info!(conf_dir = %self.conf_dir.display(), "keeping capture-cni chained");
        let mut seen: Option<Fingerprint> = None;
        let mut last_error: Option<String> = None;
        let mut throttle = Throttle::default();
        loop {
            let now_fp = self.fingerprint();
            if seen.as_ref() != Some(&now_fp) {
                // `now_fp` was taken before the check, so a change made while it ran is seen on
                // the next period rather than taken for one already handled.
                seen = match self.step(&mut throttle, metrics, state) {
                    Ok(true) => Some(now_fp),
                    Ok(false) => None,
                    Err(e) => {
                        // A file half-written by its owner, or none yet: retried on every
                        // period until it parses, said once.
                        let text = e.to_string();
                        if last_error.as_deref() != Some(&text) {
                            warn!(error = %text, "cannot chain capture-cni yet");
                            last_error = Some(text.clone());
                        }
                        metrics.chained.set(0);
                        state.update(|r| {
                            r.chained = false;
                            r.problem = Some(text);
                        });
                        None
                    }
                };
                if seen.is_some() {
                    last_error = None;
                }
            } else if let Some(over) = throttle.holds(Instant::now()) {
                metrics.fighting.set(0);
                info!(config = %over.file.display(), rechains = over.rechains, "capture-cni has stayed chained: the fight over the CNI configuration is over");
                state.update(|r| r.fight = None);
            }
            thread::sleep(PERIOD);
        }
    }

    /// One look, and a re-chaining where one is due; whether the directory's state is settled
    /// (false: look again next period).
    fn step(
        &self,
        throttle: &mut Throttle,
        metrics: &ChainMetrics,
        state: &ChainState,
    ) -> Result<bool, InstallError> {
        let dropped = match self.look()? {
            Look::NotInstalled => {
                metrics.chained.set(0);
                state.update(|r| {
                    r.chained = false;
                    r.active = None;
                    r.next_rechain_in_seconds = None;
                    r.problem = Some(format!(
                        "capture-cni is not installed in {} (uninstall-cni removed it, or install-cni has not run)",
                        self.bin_dir.display()
                    ));
                });
                return Ok(true);
            }
            Look::Chained(active) => {
                // Keeps the entry's keys up to date; no write when they are.
                self.ensure_chained()?;
                metrics.chained.set(1);
                state.update(|r| {
                    r.chained = true;
                    r.active = Some(active);
                    r.problem = None;
                    r.next_rechain_in_seconds = None;
                });
                return Ok(true);
            }
            Look::Dropped(active) => active,
        };
        let now = Instant::now();
        let wait = throttle.wait(now);
        metrics.chained.set(0);
        if !wait.is_zero() {
            state.update(|r| {
                r.chained = false;
                r.active = Some(dropped.clone());
                r.problem = Some(format!("{} was written without it", dropped.display()));
                r.next_rechain_in_seconds = Some(wait.as_secs().max(1));
            });
            return Ok(false);
        }
        let Some(config) = self.ensure_chained()? else {
            return Ok(false);
        };
        metrics.rechained.inc();
        metrics.chained.set(1);
        let conf_dir = self.conf_dir.clone();
        let fighting = throttle.fight().is_some();
        if let Some(fight) = throttle.rechained(now, now_unix(), &config, || {
            Neighbour::of(&conf_dir, Some(&config))
        }) {
            metrics.fighting.set(1);
            warn!(config = %config.display(), rechains = fight.rechains, neighbour = ?fight.neighbour, fix = %fight.fix, "the CNI configuration keeps dropping capture-cni: a fight over the CNI configuration; chaining it again less and less often (pods created while it is not chained are captured in place by the reconcile)");
        } else if fighting {
            warn!(config = %config.display(), "capture-cni dropped again in the fight over the CNI configuration; chained it again");
        } else {
            warn!(config = %config.display(), "capture-cni had been dropped from the active CNI configuration; chained it again");
        }
        let fight = throttle.fight().cloned();
        state.update(|r| {
            r.chained = true;
            r.active = Some(config);
            r.problem = None;
            r.next_rechain_in_seconds = None;
            r.fight = fight;
        });
        // Our own write changed the directory: look once more next period.
        Ok(false)
    }
}
