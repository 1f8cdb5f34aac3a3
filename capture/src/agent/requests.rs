//! The agent socket's requests besides ADD: DEL, CHECK, GC and the plugin's report of a pod it
//! left alone, and the claims they withdraw.

use std::path::PathBuf;

use tracing::{info, warn};

use super::Agent;
use crate::{
    api::{FailureKind, Response},
    claims,
    ops::{self, PodSelector},
};

impl Agent {
    pub(super) fn del(&self, container_id: String, netns: Option<PathBuf>) -> Response {
        let by_id = PodSelector::ContainerId(container_id.clone());
        let released = ops::release_pod(&self.cfg.paths, &by_id).and_then(|r| match (r, netns) {
            (None, Some(n)) => ops::release_pod(&self.cfg.paths, &PodSelector::Netns(n)),
            (r, _) => Ok(r),
        });
        match released {
            Ok(Some(r)) => {
                self.withdraw_claim(&container_id);
                info!(container = %container_id, netns = %r.netns.display(), "released");
                Response::ok("released")
            }
            Ok(None) => {
                self.withdraw_claim(&container_id);
                self.forget_left_alone(&container_id);
                Response::ok("not captured")
            }
            Err(e) => {
                warn!(container = %container_id, error = %e, "release failed");
                Response::failed(FailureKind::CaptureFailed, e.to_string())
            }
        }
    }

    /// Keeps capture-cni's report of a pod Istio injected and capture left alone, for status and
    /// metrics.
    pub(super) fn left_alone(&self, mut report: crate::left_alone::LeftAlone) -> Response {
        report.reported_at_unix = crate::record::now_unix();
        let pod = &report.pod;
        info!(namespace = %pod.namespace, pod = %pod.name, reason = report.reason.as_str(), detail = %report.detail, "left alone");
        match crate::left_alone::save(&self.cfg.paths, &report) {
            Ok(()) => Response::ok("recorded"),
            Err(e) => Response::failed(
                FailureKind::CaptureFailed,
                format!(
                    "cannot record that {}/{} is left alone in {}: {e}",
                    pod.namespace,
                    pod.name,
                    self.cfg.paths.left_alone_dir().display()
                ),
            ),
        }
    }

    pub(super) fn forget_left_alone(&self, container_id: &str) {
        if let Err(e) = crate::left_alone::forget(&self.cfg.paths, container_id) {
            warn!(container = %container_id, error = %e, "cannot remove the pod's left-alone report");
        }
    }

    pub(super) fn withdraw_claim(&self, container_id: &str) {
        if let Err(e) = claims::release(&self.cfg.paths, container_id) {
            warn!(container = %container_id, error = %e, "cannot remove the claim; DEL will wait for the agent");
        }
    }

    pub(super) fn check(&self, container_id: String) -> Response {
        match ops::pod_status(
            &self.cfg.paths,
            &PodSelector::ContainerId(container_id.clone()),
        ) {
            Ok(Some(s)) if s.in_force => {
                Response::ok(format!("capture in force ({})", s.record.mode))
            }
            Ok(Some(s)) => Response::failed(
                FailureKind::CaptureFailed,
                format!(
                    "capture is not in force for container {container_id}: missing {}",
                    s.missing.join(", ")
                ),
            ),
            Ok(None) => Response::failed(
                FailureKind::CaptureFailed,
                format!("container {container_id} is not captured"),
            ),
            Err(e) => Response::failed(FailureKind::CaptureFailed, e.to_string()),
        }
    }

    pub(super) fn gc(&self, valid: &[String]) -> Response {
        match ops::collect_garbage(&self.cfg.paths, valid) {
            Ok(released) => {
                for r in &released {
                    info!(netns = %r.netns.display(), "released by gc");
                }
                // Claims of containers the runtime no longer has: their pods were just released,
                // or were never captured (an ADD that failed before its claim was withdrawn).
                for id in claims::claimed(&self.cfg.paths).unwrap_or_default() {
                    if !valid.contains(&id) {
                        self.withdraw_claim(&id);
                    }
                }
                crate::left_alone::retain(&self.cfg.paths, |r| valid.contains(&r.pod.container_id));
                Response::ok(format!("released {} pod(s)", released.len()))
            }
            Err(e) => Response::failed(FailureKind::CaptureFailed, e.to_string()),
        }
    }
}
