//! What the agent does on its own while it serves: releases that failed tried again, what
//! half-done attaches left released, and the node's files read again.

use std::sync::Arc;

use tracing::{info, warn};

use super::{mesh_watch, Agent};
use crate::{ops, paths::Paths};

/// How often the agent tries again the releases that failed (a link pin that could not be
/// removed, say) and releases what attaches that died half-way left (and the scratch cgroups of
/// probes whose process died): the runtime retries its DEL too, but a pod deleted by hand, or
/// whose netns is gone, has no one else.
const RELEASE_RETRY: std::time::Duration = std::time::Duration::from_secs(10);

pub(super) async fn retry_failed_releases(paths: Paths) {
    let mut tick = tokio::time::interval(RELEASE_RETRY);
    loop {
        tick.tick().await;
        let p = paths.clone();
        let Ok(tried) = tokio::task::spawn_blocking(move || ops::retry_failed_releases(&p)).await
        else {
            continue;
        };
        let p = paths.clone();
        let abandoned = tokio::task::spawn_blocking(move || {
            crate::cgroup::remove_stale_scratch();
            // Reports of pods whose DEL never came (the agent was down and the runtime sends no
            // GC): their sandbox, and with it their netns, is gone.
            crate::left_alone::retain(&p, crate::left_alone::netns_exists);
            // A `capture trace` killed outright leaves its lease (expired within seconds).
            crate::trace::sweep(&p);
            ops::release_abandoned_attaches(&p)
        });
        match abandoned.await {
            Ok(Ok(cookies)) if !cookies.is_empty() => {
                warn!(netns_cookies = ?cookies, "released what attaches that died half-way left");
            }
            Ok(Err(e)) => warn!(error = %e, "releasing abandoned attaches"),
            _ => {}
        }
        match tried {
            Ok(tried) => {
                for (record, result) in tried {
                    match result {
                        Ok(()) => {
                            info!(netns = %record.netns.display(), "released after an earlier failure");
                        }
                        Err(e) => {
                            warn!(netns = %record.netns.display(), error = %e, "release failed again");
                        }
                    }
                }
            }
            Err(e) => warn!(error = %e, "retrying failed releases"),
        }
    }
}

/// Reads the mesh configuration and the annotation policy again every [`mesh_watch::POLL`], so
/// that readiness follows a fixed file without waiting for an ADD.
pub(super) async fn poll_node_files(agent: Arc<Agent>) {
    let mut tick = tokio::time::interval(mesh_watch::POLL);
    loop {
        tick.tick().await;
        let a = Arc::clone(&agent);
        let _ = tokio::task::spawn_blocking(move || {
            a.refresh_mesh();
            a.refresh_policy();
        })
        .await;
    }
}
