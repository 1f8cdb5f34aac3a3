//! What the agent does before it serves: the node's directories, its kernel programs loaded or
//! taken over, the pods that survived a restart reported, and the acceleration's checks started.

use std::sync::Arc;

use capture_user::node::NodeChoices;
use tracing::{info, warn};

use super::{Agent, AgentError};
use crate::{ops, paths::Paths, record::Mode};

pub(super) fn prepare(agent: &Agent) -> Result<(), AgentError> {
    let paths = &agent.cfg.paths;
    paths.prepare()?;
    if agent.mode == Mode::Ebpf {
        use crate::ebpf::{loader::LoadError, EbpfError};
        match crate::ebpf::adopt_or_load(paths, agent.cfg.node.sizing) {
            Ok(Some(report)) => {
                info!(from = %report.from, to = %report.to, pods = report.pods, maps = ?report.maps, "took the node over (another build, or another --max-pods)");
                for failed in &report.failed {
                    warn!(pod = %failed, "a pod's links still run the old build's programs");
                }
            }
            Ok(None) => {}
            Err(EbpfError::Load(
                e @ (LoadError::NewerLayout { .. } | LoadError::CannotCarry { .. }),
            )) => return Err(AgentError::TakeoverStopped(e)),
            Err(e) => return Err(AgentError::Programs(e)),
        }
    }
    prepare_acceleration(
        paths,
        &agent.cfg.node,
        agent.cfg.accelerate && agent.mode == Mode::Ebpf,
        &agent.cfg.accelerate_accepting,
    );
    // The node's records must read before it serves. How each pod's capture stands is
    // reported once it serves (`report_pods`): on a node of a thousand pods that look takes
    // half a second, which an upgrade's readiness need not wait for.
    crate::record::scan(paths).map_err(|e| AgentError::Status(e.into()))?;
    Ok(())
}

/// Says how the pods captured before this start stand: one line for the node, and one for
/// each pod whose capture is not fully in force. Prunes the container index first.
pub(super) fn report_pods(paths: &Paths) {
    let pruned = crate::record::prune_container_index(paths);
    if pruned > 0 {
        info!(
            pruned,
            "removed container index entries whose pod records are gone"
        );
    }
    let status = match ops::status(paths) {
        Ok(status) => status,
        Err(e) => {
            warn!(error = %e, "reading the node's captured pods");
            return;
        }
    };
    let mut in_force = 0;
    for pod in &status.pods {
        let r = &pod.record;
        if pod.in_force {
            in_force += 1;
        } else {
            warn!(netns = %r.netns.display(), mode = %r.mode, missing = ?pod.missing, "captured pod is not fully in force");
        }
    }
    info!(
        pods = status.pods.len(),
        in_force, "pods captured before this start"
    );
}

/// Records whether the node allows acceleration (and which differences it accepts) and, when it
/// does, makes sure this kernel and build get checked (in the background, if they have not
/// been). A check that cannot run is a failed verdict: acceleration stays off, and status says
/// why.
fn prepare_acceleration(
    paths: &Paths,
    choices: &Arc<NodeChoices>,
    allowed: bool,
    accepted: &[String],
) {
    let mut node = crate::accel::load(paths);
    node.allowed = allowed;
    node.accepted = accepted.to_vec();
    if let Err(e) = crate::accel::save(paths, &node) {
        warn!(error = %e, "recording the node's acceleration setting");
    }
    if !allowed
        || node
            .check
            .as_ref()
            .is_some_and(crate::accel::Verdict::is_current)
    {
        return;
    }
    // In the background: readiness does not wait for an optional feature. Pods captured before
    // the verdict are not accelerated (status says why).
    let paths = paths.clone();
    let choices = Arc::clone(choices);
    let accepted = accepted.to_vec();
    std::thread::spawn(move || run_acceleration_checks(&paths, &choices, &accepted, node));
}

fn run_acceleration_checks(
    paths: &Paths,
    choices: &NodeChoices,
    accepted: &[String],
    mut node: crate::accel::NodeAcceleration,
) {
    info!("running the acceleration's correctness checks on this kernel");
    match ops::accel_check(paths, choices) {
        Ok(report) => {
            let unaccepted = report.verdict().unaccepted(accepted);
            if unaccepted.is_empty() {
                info!(
                    cases = report.cases.len(),
                    "acceleration checks passed; pods that ask are accelerated"
                );
            } else {
                warn!(differences = ?unaccepted, "acceleration checks found differences; no pod is accelerated");
            }
        }
        Err(e) => {
            warn!(error = %e, "the acceleration checks could not run; no pod is accelerated");
            node.check = Some(crate::accel::Verdict {
                kernel: crate::accel::kernel_release(),
                build: crate::ebpf::loader::build_name(),
                cases: 0,
                failed: vec![crate::accel::FailedCase {
                    name: "the checks could not run".into(),
                    plain: e.to_string(),
                    accelerated: String::new(),
                }],
                accelerated_bytes: 0,
                checked_at_unix: crate::record::now_unix(),
            });
            let _ = crate::accel::save(paths, &node);
        }
    }
}
