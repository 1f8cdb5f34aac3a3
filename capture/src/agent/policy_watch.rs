//! The annotation policy file the agent reads (`--annotation-policy`, a ConfigMap mounted into
//! the DaemonSet). Read again before each ADD (a few hundred bytes) and every few seconds, so
//! that a change applies to the next pod without a restart, and a fixed file makes the agent
//! ready. A content that cannot be used leaves the last good policy in
//! force and is logged; with none before it (the agent's first start), the agent is not ready:
//! capturing pods without the policy the operator asked for would let them bypass it.

use std::{
    path::PathBuf,
    sync::{Mutex, PoisonError},
};

use tracing::{info, warn};

use crate::config::policy::{self, Policy};

pub struct PolicyWatch {
    path: PathBuf,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// The content last read, or why it could not be.
    seen: Option<Result<String, String>>,
    in_use: Option<Policy>,
    problem: Option<String>,
}

impl PolicyWatch {
    #[must_use]
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            state: Mutex::new(State::default()),
        }
    }

    /// Reads the file again if it changed; the policy new pods are held to, if there is one.
    pub fn refresh(&self) -> Option<Policy> {
        let read = std::fs::read_to_string(&self.path).map_err(|e| e.to_string());
        let mut state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.seen.as_ref() != Some(&read) {
            state.seen = Some(read.clone());
            let path = self.path.display();
            match read
                .map_err(|e| format!("cannot read it: {e}"))
                .and_then(|text| policy::parse(&text).map_err(|e| e.to_string()))
            {
                Ok(policy) => {
                    info!(path = %path, rules = policy.rules.len(), "annotation policy in use for new pods");
                    state.in_use = Some(policy);
                    state.problem = None;
                }
                Err(problem) => {
                    if state.in_use.is_some() {
                        warn!(path = %path, %problem, "the annotation policy cannot be used; new pods are held to the last good one");
                    } else {
                        warn!(path = %path, %problem, "the annotation policy cannot be used and none was before: not ready");
                    }
                    state.problem = Some(problem);
                }
            }
        }
        state.in_use.clone()
    }

    /// Why no policy can be applied to new pods, when none can.
    #[must_use]
    pub fn unusable(&self) -> Option<String> {
        let state = self.state.lock().unwrap_or_else(PoisonError::into_inner);
        if state.in_use.is_some() {
            return None;
        }
        Some(format!(
            "the annotation policy {} cannot be used: {} (fix the capture-annotation-policy ConfigMap, or drop --annotation-policy)",
            self.path.display(),
            state.problem.as_deref().unwrap_or("not read yet")
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
