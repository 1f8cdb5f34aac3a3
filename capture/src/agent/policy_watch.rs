//! The annotation policy file the agent reads (`--annotation-policy`, a ConfigMap mounted into
//! the DaemonSet). Read again before each ADD (a few hundred bytes) and every few seconds, so
//! that a change applies to the next pod without a restart, and a fixed file makes the agent
//! ready. A content that cannot be used leaves the last good policy in
//! force and is logged; with none before it (the agent's first start), the agent is not ready:
//! capturing pods without the policy the operator asked for would let them bypass it.

use std::sync::{Mutex, PoisonError};

use tracing::{info, warn};

use super::last_good::{text, LastGood, Refreshed};
use crate::config::policy::{self, Policy};

pub struct PolicyWatch {
    file: Mutex<LastGood<Policy>>,
}

impl PolicyWatch {
    #[must_use]
    pub fn new(path: std::path::PathBuf) -> Self {
        Self {
            file: Mutex::new(LastGood::new(path)),
        }
    }

    /// Reads the file again if it changed; the policy new pods are held to, if there is one.
    pub fn refresh(&self) -> Option<Policy> {
        let mut file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        let parse = |data: &[u8]| policy::parse(text(data)?).map_err(|e| e.to_string());
        let had_one = file.in_use().is_some();
        let path = file.path().display().to_string();
        match file.refresh(parse) {
            Refreshed::Unchanged => {}
            Refreshed::InUse => {
                let rules = file.in_use().map_or(0, |p| p.rules.len());
                info!(path = %path, rules, "annotation policy in use for new pods");
            }
            Refreshed::Unusable => {
                let problem = file.problem().unwrap_or_default();
                if had_one {
                    warn!(path = %path, %problem, "the annotation policy cannot be used; new pods are held to the last good one");
                } else {
                    warn!(path = %path, %problem, "the annotation policy cannot be used and none was before: not ready");
                }
            }
        }
        file.in_use().cloned()
    }

    /// Why no policy can be applied to new pods, when none can.
    #[must_use]
    pub fn unusable(&self) -> Option<String> {
        let file = self.file.lock().unwrap_or_else(PoisonError::into_inner);
        if file.in_use().is_some() {
            return None;
        }
        Some(format!(
            "the annotation policy {} cannot be used: {} (fix the capture-annotation-policy ConfigMap, or drop --annotation-policy)",
            file.path().display(),
            file.problem().unwrap_or("not read yet")
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_file_keeps_the_last_good_policy_and_none_before_is_unusable() {
        let dir = std::env::temp_dir().join(format!("capture-policy-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = dir.join("policy.yaml");
        let watch = PolicyWatch::new(file.clone());
        assert_eq!(watch.refresh(), None);
        assert!(watch.unusable().unwrap().contains("cannot read it"));
        std::fs::write(&file, "rules: [").unwrap();
        assert_eq!(watch.refresh(), None);
        assert!(watch.unusable().is_some());
        std::fs::write(&file, "rules: [{name: a, annotations: {x: deny}}]").unwrap();
        assert_eq!(watch.refresh().map(|p| p.rules.len()), Some(1));
        assert_eq!(watch.unusable(), None);
        std::fs::write(&file, "rules: 3").unwrap();
        assert_eq!(
            watch.refresh().map(|p| p.rules.len()),
            Some(1),
            "the last good one"
        );
        std::fs::write(&file, "").unwrap();
        assert_eq!(watch.refresh().map(|p| p.rules.len()), Some(0));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
