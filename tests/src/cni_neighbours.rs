//! Stand-ins for network plugins that rewrite the node's CNI configuration, each doing what the
//! real one does to the configuration directory:
//!
//! - AWS VPC CNI (`aws-node`) and Calico (`calico-node`'s install-cni) write their conflist whole
//!   at each start: [`rewrite_whole`].
//! - Cilium with `cni.exclusive=true` watches the directory and, on any change, writes its own
//!   conflist again when its content differs and renames every other `.conf`, `.conflist` and
//!   `.json` file to `*.cilium_bak` (cilium's `cniConfigManager`: `setupCNIConfFile`,
//!   `cleanupOtherCNI`, `watchForDirectoryChanges`): [`CiliumExclusive`].

use std::{
    path::Path,
    sync::{
        atomic::{AtomicBool, AtomicU64, Ordering},
        Arc,
    },
    thread::JoinHandle,
    time::Duration,
};

use serde_json::Value;

/// Writes `conf` the way network plugins install their configuration: a temporary file in the
/// same directory, renamed over the target.
pub fn rewrite_whole(file: &Path, conf: &Value) {
    let tmp = file.with_extension("tmp-by-plugin");
    std::fs::write(&tmp, serde_json::to_string_pretty(conf).unwrap()).unwrap();
    std::fs::rename(&tmp, file).unwrap();
}

/// Cilium's agent with `cni.exclusive=true`, owning a configuration directory until dropped.
pub struct CiliumExclusive {
    stop: Arc<AtomicBool>,
    rewrites: Arc<AtomicU64>,
    thread: Option<JoinHandle<()>>,
}

/// The name Cilium writes its configuration under.
pub const CILIUM_CONFLIST: &str = "05-cilium.conflist";

impl CiliumExclusive {
    /// Starts watching `conf_dir`, writing `own` as its configuration.
    pub fn start(conf_dir: &Path, own: &Value) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let rewrites = Arc::new(AtomicU64::new(0));
        let (dir, text) = (
            conf_dir.to_path_buf(),
            serde_json::to_string_pretty(own).unwrap(),
        );
        let (s, r) = (Arc::clone(&stop), Arc::clone(&rewrites));
        let thread = std::thread::spawn(move || {
            let mut seen = None;
            while !s.load(Ordering::Relaxed) {
                // fsnotify's events, by a listing taken often enough to answer within a moment.
                let now = listing(&dir);
                if seen.as_ref() != Some(&now) {
                    if setup(&dir, &text) {
                        r.fetch_add(1, Ordering::Relaxed);
                    }
                    seen = Some(listing(&dir));
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        });
        Self {
            stop,
            rewrites,
            thread: Some(thread),
        }
    }

    /// How many times it wrote its configuration again.
    #[must_use]
    pub fn rewrites(&self) -> u64 {
        self.rewrites.load(Ordering::Relaxed)
    }
}

impl Drop for CiliumExclusive {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Each file's name and content.
fn listing(dir: &Path) -> Vec<(String, Vec<u8>)> {
    let mut files: Vec<(String, Vec<u8>)> = std::fs::read_dir(dir)
        .map(|d| {
            d.flatten()
                .map(|e| {
                    let name = e.file_name().to_string_lossy().into_owned();
                    (name, std::fs::read(e.path()).unwrap_or_default())
                })
                .collect()
        })
        .unwrap_or_default();
    files.sort();
    files
}

/// One pass of Cilium's `setupCNIConfFile`: its file written where its content differs, the
/// others renamed away. Whether it wrote its file.
fn setup(dir: &Path, own: &str) -> bool {
    let dest = dir.join(CILIUM_CONFLIST);
    let wrote = std::fs::read_to_string(&dest).ok().as_deref() != Some(own);
    if wrote {
        let tmp = dir.join(".05-cilium.conflist.tmp");
        std::fs::write(&tmp, own).unwrap();
        std::fs::rename(&tmp, &dest).unwrap();
    }
    for entry in std::fs::read_dir(dir).into_iter().flatten().flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let config = [".conf", ".conflist", ".json"]
            .iter()
            .any(|ext| name.ends_with(ext));
        if config && name != CILIUM_CONFLIST && entry.file_type().is_ok_and(|t| t.is_file()) {
            let mut to = entry.path();
            to.set_file_name(format!("{name}.cilium_bak"));
            let _ = std::fs::rename(entry.path(), to);
        }
    }
    wrote
}
