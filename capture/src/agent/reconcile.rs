//! The runtime reconcile: at start and every `--reconcile-period`, the agent lists the node's pod
//! sandboxes over CRI and holds them against its records (`runtime::view`).
//!
//! - A meshed sandbox capture never saw (it started before `install-cni`, or while the network
//!   plugin's rewrite of the CNI configuration had dropped capture-cni) is repaired by `--repair`:
//!   captured in place as CNI ADD would have captured it (annotations and addresses from the
//!   runtime, listeners adopted, open connections left as they are), its sandbox stopped so that
//!   the kubelet recreates it through the CNI chain, or only reported.
//! - A record whose sandbox the runtime no longer lists or lists stopped (a DEL that never came:
//!   containerd 1.6 sends no CNI GC) is released as DEL would release it, once its netns is gone
//!   too in two passes in a row: a runtime lists a sandbox only once its ADD has returned, but
//!   the netns of a sandbox being set up exists.
//!
//! The runtime is asked before anything else and with a deadline, and nothing holds the node lock
//! while it answers; a pass whose listing fails changes nothing and says why.

use std::{
    collections::{BTreeMap, BTreeSet, HashMap},
    path::PathBuf,
    sync::{
        atomic::{AtomicBool, Ordering},
        Arc,
    },
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use tracing::{info, warn};

use super::Agent;
use crate::{
    api::PodRequest,
    netns::{Netns, NetnsError},
    ops,
    pod_cgroup::find_pod_cgroup,
    record::{self, PodRef, PodSelector},
    runtime::{
        cri::{Cri, Events, CALL_TIMEOUT},
        node_view,
        report::{self, ReconcileReport, Repair, Uncaptured},
        selection_rules, Orphan, Sandbox, Standing,
    },
    sockdiag::{self, SockDiagError},
};

#[derive(Clone, Debug)]
pub struct ReconcileConfig {
    pub cri_socket: PathBuf,
    pub repair: Repair,
    pub period: Duration,
    /// Where the chained capture-cni entry says which pods are meshed.
    pub cni_conf_dir: PathBuf,
}

/// What one pass remembers for the next.
#[derive(Default)]
struct Memory {
    /// Records (netns cookies) whose sandbox and netns were gone at the last pass.
    missing: BTreeSet<u64>,
    /// Records without a running sandbox kept because their netns exists (logged once).
    kept: BTreeSet<u64>,
    /// Sandboxes already stopped: each is restarted once.
    restarted: BTreeSet<String>,
    /// Whether the runtime answered last time (a change is logged, not every pass).
    reachable: Option<bool>,
    /// The uncaptured sandboxes logged, with the outcome logged for each.
    told: BTreeMap<String, String>,
}

/// Runs a pass now and then every period, until the agent stops.
pub async fn run(agent: Arc<Agent>, cfg: ReconcileConfig) {
    let cri = match Cri::new(&cfg.cri_socket, CALL_TIMEOUT) {
        Ok(cri) => cri,
        Err(e) => {
            warn!(error = %e, "no runtime reconcile");
            return;
        }
    };
    let mut memory = Memory::default();
    let mut tick = tokio::time::interval(cfg.period);
    // A pass that waited on a slow runtime is followed by one pass, not a burst.
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let events = Arc::new(EventStream::default());
    tokio::spawn(watch_events(cri.clone(), Arc::clone(&events), cfg.period));
    loop {
        tokio::select! {
            _ = tick.tick() => {}
            () = events.wake.notified() => {
                // A pod's sandbox and containers start together: one pass for the burst.
                tokio::time::sleep(EVENT_SETTLE).await;
                tick.reset();
            }
        }
        let (mut report, unsettled) = pass(&agent, &cri, &cfg, &mut memory).await;
        report.event_stream = events.open.load(Ordering::Relaxed);
        agent.metrics.set_uncaptured(unsettled);
        agent
            .metrics
            .set_runtime_reachable(report.runtime_error.is_none());
        if let Err(e) = report::save(&agent.cfg.paths, &report) {
            warn!(error = %e, "keeping the reconcile report");
        }
    }
}

/// How long a pass woken by an event waits for the rest of the burst.
const EVENT_SETTLE: Duration = Duration::from_millis(500);

/// The runtime's event stream as the passes see it.
#[derive(Default)]
struct EventStream {
    /// Woken by each event.
    wake: tokio::sync::Notify,
    /// Whether the stream is open now.
    open: AtomicBool,
}

/// Wakes a pass on each of the runtime's container events, where the runtime offers them, so
/// that a pod that starts uncaptured is repaired at once rather than within the period; the
/// periodic passes go on beside it. A stream that ends or fails is opened again a period later.
async fn watch_events(cri: Cri, events: Arc<EventStream>, period: Duration) {
    let mut told = None;
    loop {
        let outcome = match cri.events().await {
            Ok(Events::Unoffered) => {
                info!("the runtime offers no event stream (GetContainerEvents): the reconcile runs every period");
                return;
            }
            Ok(Events::Stream(mut stream)) => {
                events.open.store(true, Ordering::Relaxed);
                if told != Some(true) {
                    info!("reading the runtime's events: a pass follows each burst");
                    told = Some(true);
                }
                while let Ok(Some(_event)) = stream.message().await {
                    events.wake.notify_one();
                }
                events.open.store(false, Ordering::Relaxed);
                "the runtime's event stream ended".to_owned()
            }
            Err(e) => e.to_string(),
        };
        if told != Some(false) {
            info!(why = %outcome, "not reading the runtime's events; trying again every period");
            told = Some(false);
        }
        tokio::time::sleep(period).await;
    }
}

fn now_unix() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// One pass: its report, and how many meshed pods it leaves running uncaptured (a pod it
/// captured or stopped is not one).
async fn pass(
    agent: &Arc<Agent>,
    cri: &Cri,
    cfg: &ReconcileConfig,
    memory: &mut Memory,
) -> (ReconcileReport, usize) {
    let mut report = ReconcileReport {
        at_unix: now_unix(),
        cri_socket: cfg.cri_socket.display().to_string(),
        repair: Some(cfg.repair),
        period_secs: cfg.period.as_secs(),
        ..ReconcileReport::default()
    };
    let listed = match cri.list().await {
        Ok(s) => s,
        Err(e) => {
            if memory.reachable != Some(false) {
                warn!(error = %e, "the container runtime cannot be read: nothing is repaired or released until it can");
            }
            memory.reachable = Some(false);
            report.runtime_error = Some(e.to_string());
            return (report, 0);
        }
    };
    if memory.reachable != Some(true) {
        info!(socket = %cfg.cri_socket.display(), sandboxes = listed.len(), repair = %cfg.repair, "reading the container runtime");
    }
    memory.reachable = Some(true);
    report.sandboxes = listed.len();
    let paths = agent.cfg.paths.clone();
    let conf_dir = cfg.cni_conf_dir.clone();
    let read = tokio::task::spawn_blocking(move || {
        let records = record::load_all(&paths)?;
        Ok::<_, record::RecordError>((records, selection_rules(&conf_dir).0))
    })
    .await;
    let (records, selection) = match read {
        Ok(Ok(v)) => v,
        Ok(Err(e)) => {
            warn!(error = %e, "reading the pod records for the reconcile");
            return (report, 0);
        }
        Err(e) => {
            warn!(error = %e, "the reconcile's reading thread failed");
            return (report, 0);
        }
    };
    let view = node_view(&listed, &records, &selection);
    let by_id: HashMap<&str, &Sandbox> = listed.iter().map(|s| (s.id.as_str(), s)).collect();
    let mut told = BTreeMap::new();
    let mut unsettled = 0;
    for seen in view.uncaptured() {
        let Some(&listed) = by_id.get(seen.sandbox_id.as_str()) else {
            continue;
        };
        let why = seen.why.clone().unwrap_or_default();
        let acted = if seen.standing == Standing::MeshedNotCaptured {
            // Only a repair candidate is asked for its network: one status call per candidate,
            // not per sandbox of the node.
            let mut sandbox = listed.clone();
            match cri.describe(&mut sandbox).await {
                // Gone since the list.
                Ok(false) => continue,
                // No CNI ADD ever runs for a pod on the node's network: not meshed.
                Ok(true) if sandbox.host_network => continue,
                Ok(true) => {}
                Err(e) => {
                    warn!(pod = %seen.pod, error = %e, "the runtime did not describe a sandbox");
                }
            }
            repair(agent, cri, cfg.repair, &sandbox, &selection, memory).await
        } else {
            Acted {
                action: "none".to_owned(),
                result: "pending".to_owned(),
                settled: false,
            }
        };
        let Acted {
            action,
            result,
            settled,
        } = acted;
        unsettled += usize::from(!settled);
        // Once per sandbox and outcome: a pod reported every pass would bury the log.
        if memory.told.get(&seen.sandbox_id) != Some(&result) {
            warn!(pod = %seen.pod, sandbox = %seen.sandbox_id, %why, %action, %result, "meshed, not captured");
        }
        told.insert(seen.sandbox_id.clone(), result.clone());
        report.uncaptured.push(Uncaptured {
            pod: seen.pod.clone(),
            sandbox_id: seen.sandbox_id.clone(),
            why,
            action,
            result,
        });
    }
    release_orphans(agent, &view.orphans, memory, &mut report).await;
    memory.told = told;
    (report, unsettled)
}

/// Releases, as DEL would, the records whose sandbox the runtime no longer lists or lists
/// stopped, once their netns is gone too and they were orphans in the pass before: a sandbox
/// whose ADD is still under way is not listed yet, but its netns exists.
async fn release_orphans(
    agent: &Arc<Agent>,
    orphans: &[Orphan],
    memory: &mut Memory,
    report: &mut ReconcileReport,
) {
    let candidates: Vec<(PathBuf, u64)> = orphans
        .iter()
        .map(|o| (PathBuf::from(&o.netns), o.netns_cookie))
        .collect();
    let gone = tokio::task::spawn_blocking(move || {
        candidates
            .iter()
            .map(|(path, cookie)| netns_gone(path, *cookie))
            .collect::<Vec<bool>>()
    })
    .await
    .unwrap_or_default();
    let mut missing = BTreeSet::new();
    let mut kept = BTreeSet::new();
    for (orphan, gone) in orphans.iter().zip(gone) {
        if !gone {
            if !memory.kept.contains(&orphan.netns_cookie) {
                info!(pod = %orphan.pod, netns = %orphan.netns, sandbox = %orphan.sandbox, "a record without a running sandbox keeps its capture while its netns exists");
            }
            kept.insert(orphan.netns_cookie);
            continue;
        }
        missing.insert(orphan.netns_cookie);
        if !memory.missing.contains(&orphan.netns_cookie) {
            continue;
        }
        let paths = agent.cfg.paths.clone();
        let which = PodSelector::ContainerId(orphan.container_id.clone());
        let released = tokio::task::spawn_blocking(move || ops::release_pod(&paths, &which)).await;
        let ok = matches!(released, Ok(Ok(_)));
        agent.metrics.count_repair("release", ok);
        if ok {
            agent.forget_left_alone(&orphan.container_id);
            info!(pod = %orphan.pod, netns = %orphan.netns, sandbox = %orphan.sandbox, "released: its sandbox and netns are gone (a DEL that never came)");
            report.released.push(orphan.pod.clone());
        } else {
            warn!(pod = %orphan.pod, result = ?released, "releasing a pod whose sandbox is gone");
        }
    }
    memory.missing = missing;
    memory.kept = kept;
}

/// Whether the netns a record names is gone: its path no longer exists, is no netns (unmounted),
/// or names another netns. Anything else (a netns that cannot be read) counts as present.
fn netns_gone(path: &std::path::Path, cookie: u64) -> bool {
    match Netns::open(path) {
        Ok(netns) => netns
            .cookie(crate::ebpf::netns_cookie::netns_cookie)
            .is_ok_and(|now| now != cookie),
        Err(NetnsError::NotNetns { .. }) => true,
        Err(NetnsError::Open { source, .. }) => source.kind() == std::io::ErrorKind::NotFound,
        Err(_) => false,
    }
}

/// What became of one uncaptured sandbox in a pass.
struct Acted {
    action: String,
    /// In words, for the report and the log.
    result: String,
    /// The pod no longer runs uncaptured: captured in place, or its sandbox stopped.
    settled: bool,
}

/// Acts on one meshed, ready, uncaptured sandbox.
async fn repair(
    agent: &Arc<Agent>,
    cri: &Cri,
    mode: Repair,
    sandbox: &Sandbox,
    selection: &crate::cni::PluginConfig,
    memory: &mut Memory,
) -> Acted {
    let unsettled = |result: &str| Acted {
        action: mode.to_string(),
        result: result.to_owned(),
        settled: false,
    };
    let result = match mode {
        Repair::Report => return unsettled("reported"),
        Repair::Restart => {
            if memory.restarted.contains(&sandbox.id) {
                return unsettled("pending (stopped already)");
            }
            // A stop that failed is tried again next pass.
            let stopped = cri.stop_sandbox(&sandbox.id).await;
            if stopped.is_ok() {
                memory.restarted.insert(sandbox.id.clone());
            }
            stopped.map(|()| "ok".to_owned()).map_err(|e| e.to_string())
        }
        Repair::Capture => match pod_request(sandbox, selection) {
            Ok(pod) => capture_in_place(agent, pod).await,
            Err(why) => Err(why),
        },
    };
    agent
        .metrics
        .count_repair(&mode.to_string(), result.is_ok());
    match result {
        Ok(ok) => Acted {
            action: mode.to_string(),
            result: ok,
            settled: true,
        },
        Err(why) => unsettled(&format!("failed: {why}")),
    }
}

/// Attaches as ADD would, sparing the pod's open connections (`AttachRequest::in_place`).
/// They are counted first: the log and `capture_repair_connections_left_open_total` say how
/// many still bypass the proxy until they close.
async fn capture_in_place(agent: &Arc<Agent>, pod: PodRequest) -> Result<String, String> {
    let a = Arc::clone(agent);
    let joined = tokio::task::spawn_blocking(move || {
        let left_open = open_connections(&pod.netns);
        let name = pod.pod.clone();
        (a.add(pod, true), left_open, name)
    })
    .await;
    let (response, left_open, name) = joined.map_err(|e| e.to_string())?;
    if !response.ok {
        return Err(response.error.unwrap_or_default());
    }
    match left_open {
        Ok(0) => Ok("ok".to_owned()),
        Ok(n) => {
            agent.metrics.count_left_open(n);
            info!(pod = %format!("{}/{}", name.namespace, name.name), connections = n, "captured in place; connections opened before stay on their path until they close");
            Ok(format!(
                "ok (connections opened before capture, left as they are: {n})"
            ))
        }
        Err(e) => {
            warn!(error = %e, "counting the connections a repaired pod had open");
            Ok("ok".to_owned())
        }
    }
}

fn open_connections(netns: &std::path::Path) -> Result<usize, SockDiagError> {
    Ok(sockdiag::open_connections(&Netns::open(netns)?)?.len())
}

/// The ADD capture-cni would have sent for `sandbox`: its netns and addresses from the runtime,
/// its cgroup found from its uid as the plugin finds it.
fn pod_request(
    sandbox: &Sandbox,
    selection: &crate::cni::PluginConfig,
) -> Result<PodRequest, String> {
    let netns = sandbox
        .netns
        .clone()
        .ok_or("the runtime does not say where its netns is")?;
    // Before the addresses: a runtime gives none for a sandbox whose netns path is gone. (A
    // `/proc/<pid>/...` path is the node's pid's.)
    if !crate::paths::on_node(&netns).exists() {
        return Err(format!(
            "its netns {} is gone (removed under the running pod); restart the pod",
            netns.display()
        ));
    }
    if sandbox.ips.is_empty() {
        return Err("the runtime gives it no address".into());
    }
    let root = match &selection.cgroup_root {
        Some(root) => root.clone(),
        None => crate::cgroup::cgroup2_mount().map_err(|e| e.to_string())?,
    };
    let cgroup = find_pod_cgroup(&root, &sandbox.uid)?;
    Ok(PodRequest {
        netns,
        cgroup,
        pod_ips: sandbox.ips.clone(),
        annotations: sandbox.annotations.clone(),
        labels: Some(sandbox.labels.clone()),
        pod: PodRef {
            namespace: sandbox.namespace.clone(),
            name: sandbox.name.clone(),
            uid: sandbox.uid.clone(),
            container_id: sandbox.id.clone(),
        },
    })
}
