//! docs/results/reconcile-cost.md: the CPU one reconcile pass of the agent costs on a node with
//! many pod sandboxes, measured on a synthetic node: a CRI `ListPodSandbox` answer of N sandboxes (as the
//! runtime's bytes, decoded as the client decodes them), N pod records on disk, the chained
//! capture-cni entry. A pass runs what the agent's runs between the runtime's answer and its
//! actions: decode, the sandboxes from the list, the records read, the selection rules, the
//! node view with its repair candidates. The socket round trip and the status
//! calls (one per repair candidate; none on a node where every meshed pod is captured) are not
//! in it.

use std::{
    collections::{BTreeMap, HashMap},
    fmt::Write as _,
    net::IpAddr,
    path::{Path, PathBuf},
    time::Duration,
};

use capture_user::{
    config::{CaptureConfig, PodSpec},
    paths::Paths,
    record::{self, Mode, PodRecord, PodRef},
    runtime::{node_view, selection_rules, Sandbox},
};
use k8s_cri::v1::{ListPodSandboxResponse, PodSandbox, PodSandboxMetadata, PodSandboxState};
use prost::Message as _;

const INJECTED: &str = r#"{"initContainers":["istio-validation"],"containers":["istio-proxy"],"volumes":["istio-envoy"]}"#;

/// The figures of one measurement.
pub struct ReconcileCost {
    pub sandboxes: usize,
    pub meshed: usize,
    pub rounds: usize,
    /// CPU time of one pass, each round's.
    pub passes: Vec<Duration>,
    pub kernel: String,
}

/// A node of `n` sandboxes, nine in ten meshed and captured (their records on disk), the rest
/// plain; returns the list's bytes and the node's paths.
fn synthetic_node(n: usize, dir: &Path) -> (Vec<u8>, Paths, PathBuf) {
    let paths = Paths::new(dir.join("bpffs"), dir.join("state"));
    // Only the records' directory: a pass reads nothing else of the state directory.
    std::fs::create_dir_all(
        paths
            .record_path(0)
            .parent()
            .expect("the records' directory"),
    )
    .expect("state directories");
    let conf_dir = dir.join("net.d");
    std::fs::create_dir_all(&conf_dir).expect("conf dir");
    std::fs::write(
        conf_dir.join("10-bridge.conflist"),
        r#"{"cniVersion":"1.0.0","name":"k8s","plugins":[{"type":"bridge"},{"type":"capture-cni","agent_socket":"/run/capture/agent.sock"}]}"#,
    )
    .expect("conflist");
    let mut items = Vec::with_capacity(n);
    for i in 0..n {
        let meshed = i % 10 != 0;
        let id = format!("{i:064x}");
        let name = format!("pod-{i}");
        let mut annotations = HashMap::new();
        annotations.insert("kubernetes.io/config.source".to_string(), "api".to_string());
        if meshed {
            annotations.insert("sidecar.istio.io/status".to_string(), INJECTED.to_string());
            let ip: IpAddr = format!("10.{}.{}.{}", i >> 16 & 0xff, i >> 8 & 0xff, i & 0xff)
                .parse()
                .expect("an address");
            let spec = PodSpec {
                pod_ips: vec![ip],
                ..PodSpec::default()
            };
            let record = PodRecord {
                netns_cookie: 1000 + i as u64,
                netns: PathBuf::from(format!("/var/run/netns/cni-{i}")),
                cgroup: PathBuf::from(format!("/sys/fs/cgroup/kubepods/pod{i}")),
                mode: Mode::Ebpf,
                annotations: BTreeMap::new(),
                config: CaptureConfig::from_pod(&spec).expect("a configuration"),
                attached_at_unix: 0,
                pod: Some(PodRef {
                    namespace: "shop".into(),
                    name: name.clone(),
                    uid: format!("uid-{i}"),
                    container_id: id.clone(),
                }),
                fallback_reason: None,
                fallback_cause: None,
                release_failed: None,
                iptables: None,
                settings: Vec::new(),
                proxy_container: None,
                proxy_settings_refused: None,
            };
            record::save(&paths, &record).expect("a record");
        }
        items.push(PodSandbox {
            id,
            metadata: Some(PodSandboxMetadata {
                name,
                uid: format!("uid-{i}"),
                namespace: "shop".into(),
                attempt: 0,
            }),
            state: PodSandboxState::SandboxReady as i32,
            annotations,
            ..PodSandbox::default()
        });
    }
    let list = ListPodSandboxResponse { items }.encode_to_vec();
    (list, paths, conf_dir)
}

/// This thread's CPU time.
fn thread_cpu() -> Duration {
    let t = nix::time::clock_gettime(nix::time::ClockId::CLOCK_THREAD_CPUTIME_ID)
        .expect("the thread's CPU clock");
    Duration::from(t)
}

/// One pass over the synthetic node; the number of repair candidates (0: all captured).
fn pass(list: &[u8], paths: &Paths, conf_dir: &Path) -> usize {
    let listed = ListPodSandboxResponse::decode(list).expect("the list decodes");
    let sandboxes: Vec<Sandbox> = listed.items.iter().map(Sandbox::listed).collect();
    let records = record::load_all(paths).expect("the records");
    let (selection, _) = selection_rules(conf_dir);
    let view = node_view(&sandboxes, &records, &selection);
    assert_eq!(view.sandboxes.len(), sandboxes.len());
    view.uncaptured().count()
}

/// Measures `rounds` passes over a node of `sandboxes` sandboxes.
#[must_use]
pub fn measure(sandboxes: usize, rounds: usize) -> ReconcileCost {
    let dir = std::env::temp_dir().join(capture_tests::unique("capture-reconcile-cost"));
    let (list, paths, conf_dir) = synthetic_node(sandboxes, &dir);
    // The first pass warms the page cache and the allocator.
    assert_eq!(
        pass(&list, &paths, &conf_dir),
        0,
        "every meshed pod is captured"
    );
    let passes = (0..rounds)
        .map(|_| {
            let start = thread_cpu();
            pass(&list, &paths, &conf_dir);
            thread_cpu().saturating_sub(start)
        })
        .collect();
    let _ = std::fs::remove_dir_all(&dir);
    ReconcileCost {
        sandboxes,
        meshed: sandboxes - sandboxes.div_ceil(10),
        rounds,
        passes,
        kernel: super::kernel_release(),
    }
}

#[must_use]
pub fn markdown(c: &ReconcileCost) -> String {
    let mut sorted = c.passes.clone();
    sorted.sort();
    let ms = |d: Duration| d.as_secs_f64() * 1000.0;
    let median = sorted.get(sorted.len() / 2).copied().unwrap_or_default();
    let max = sorted.last().copied().unwrap_or_default();
    let min = sorted.first().copied().unwrap_or_default();
    let mut o = String::new();
    let _ = writeln!(o, "# What a reconcile pass costs\n");
    let _ = writeln!(
        o,
        "Generated by `cargo xtask bench --reconcile-cost` on kernel {}: {} passes over a synthetic node of {} pod sandboxes ({} meshed and captured, their records on disk; the rest plain), after one warm-up pass. The CPU time is the measuring thread's (`CLOCK_THREAD_CPUTIME_ID`).\n",
        c.kernel, c.rounds, c.sandboxes, c.meshed
    );
    let _ = writeln!(
        o,
        "A pass is what the agent's reconcile runs between the runtime's answer and its actions: the `ListPodSandbox` answer decoded, the sandboxes from it, every pod record read from the state directory, the chained capture-cni entry's selection rules, the node view with its repair candidates. Not in it: the socket round trip, and one `PodSandboxStatus` call per repair candidate (none on a node where every meshed pod is captured).\n"
    );
    let _ = writeln!(
        o,
        "| sandboxes | CPU per pass, median | min | max | target |"
    );
    let _ = writeln!(o, "|---|---|---|---|---|");
    let _ = writeln!(
        o,
        "| {} | {:.1} ms | {:.1} ms | {:.1} ms | ≤ 50 ms: {} |",
        c.sandboxes,
        ms(median),
        ms(min),
        ms(max),
        if ms(median) <= 50.0 { "met" } else { "MISSED" }
    );
    o
}
