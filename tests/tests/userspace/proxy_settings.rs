//! Each pod's settings from where istio-cni takes them, with a real containerd and runc: at ADD
//! the mesh configuration of the pod's revision (two revisions on one node, each its own; a
//! revision without one refused, naming its ConfigMap), and once the runtime creates the pod's
//! `istio-proxy` container, that container's environment and `runAsUser`/`runAsGroup`
//! (`ExtractPodInfo`, `NewRedirect` in istio/istio `cni/pkg/plugin`), applied in place, on real
//! traffic: DNS to 15053 or 15001, the proxy's own uid exempt, an app container as 1337 captured.

use capture_tests::{
    cni::Node,
    containerd::{
        containers::Extra,
        image::{PAUSE_IMAGE, PROBE, PROXY_IMAGE},
        Containerd, CriPod, PodSpec,
    },
    wait::wait_until,
};
use serde_json::Value;

use super::reconcile::PATIENCE;

const DNS_ON: &str = "defaultConfig:\n  proxyMetadata:\n    ISTIO_META_DNS_CAPTURE: \"true\"\n";
const DNS_OFF: &str = "defaultConfig:\n  proxyMetadata: {}\n";

/// The sidecar status the injector of `revision` writes.
fn status(revision: &str) -> String {
    format!(
        r#"{{"initContainers":["istio-validation"],"containers":["istio-proxy"],"revision":"{revision}"}}"#
    )
}

/// A pod with the sidecar status `status` (none where empty).
fn run(runtime: &Containerd, name: &str, status: &str, proxy: bool) -> Option<CriPod> {
    let annotations = [("sidecar.istio.io/status", status)];
    let spec = PodSpec {
        name,
        namespace: "default",
        annotations: if status.is_empty() { &[] } else { &annotations },
        proxy,
    };
    runtime.run_pod_or_skip(&spec)
}

/// The pod's record in `capture status --json`.
fn record(node: &Node, pod: &CriPod) -> Value {
    node.status()["pods"]
        .as_array()
        .and_then(|pods| {
            pods.iter()
                .find(|p| p["pod"]["container_id"] == pod.id.as_str())
        })
        .cloned()
        .unwrap_or_else(|| panic!("{} is not captured: {}", pod.name, node.status()))
}

fn setting(record: &Value, name: &str) -> Value {
    record["settings"]
        .as_array()
        .and_then(|s| s.iter().find(|s| s["name"] == name))
        .cloned()
        .unwrap_or_else(|| panic!("no setting {name}: {record:#}"))
}

/// Injector's `istio-proxy`: serves outbound, inbound and the DNS proxy's port once its first
/// connection to `dial` went through (a proxy reaches its control plane first).
fn istio_proxy<'a>(uid: i64, gid: i64, dial: &'a str, env: &'a [(&'a str, &'a str)]) -> Extra<'a> {
    Extra {
        name: "istio-proxy",
        image: PROXY_IMAGE,
        uid,
        gid,
        groups: &[],
        command: Some(
            [
                PROBE,
                "serve",
                "--dial-first",
                dial,
                "--tcp",
                "outbound=0.0.0.0:15001",
                "--tcp",
                "inbound=0.0.0.0:15006",
                "--tcp",
                "dns=0.0.0.0:15053",
            ]
            .iter()
            .map(ToString::to_string)
            .collect(),
        ),
        attempt: 0,
        env,
    }
}

/// The pod's settings came from its proxy container (or say why not).
fn wait_applied(node: &Node, pod: &CriPod) -> Value {
    wait_until(PATIENCE, "the proxy container's settings applied", || {
        let r = record(node, pod);
        if r["proxy_container"].is_object() {
            Ok(r)
        } else {
            Err(r.to_string())
        }
    })
}

#[test]
fn two_revisions_on_one_node_each_get_their_mesh_and_a_revision_without_one_is_refused() {
    let node = Node::new();
    node.install_cni();
    let mesh = node.scratch_file("mesh/istio");
    std::fs::write(&mesh, DNS_OFF).unwrap();
    std::fs::write(mesh.with_file_name("istio-canary"), DNS_ON).unwrap();
    let runtime = Containerd::start(&node);
    let dir = mesh.parent().unwrap().to_str().unwrap();
    let agent = node.start_agent_with(
        "ebpf",
        &[
            "--mesh-config",
            dir,
            "--cri-socket",
            runtime.socket().to_str().unwrap(),
        ],
    );
    let Some(dest) = run(&runtime, "dest", "", false) else {
        return;
    };
    let (to, dns) = (format!("{}:8080", dest.ip), format!("{}:53", dest.ip));
    // Their proxies are no `istio-proxy` container: the settings stay ADD's.
    let (Some(stable), Some(canary)) = (
        run(&runtime, "stable", &status("default"), true),
        run(&runtime, "canary", &status("canary"), true),
    ) else {
        return;
    };
    let on = setting(&record(&node, &canary), "dns_capture");
    assert_eq!(
        (on["value"].as_str(), on["source"].as_str()),
        (Some("true"), Some("mesh")),
        "{on}"
    );
    assert!(
        on["from"].as_str().unwrap().starts_with("istio-canary "),
        "{on}"
    );
    let off = setting(&record(&node, &stable), "dns_capture");
    assert_eq!(off["value"], "false", "{off}");
    // On traffic: DNS over TCP goes to the DNS proxy's port only in the canary's pods; in the
    // stable revision's it is captured like any other connection.
    for (pod, listener) in [(&canary, "dns"), (&stable, "outbound")] {
        let extra = Extra {
            name: "dns-listener",
            command: Some(
                [PROBE, "serve", "--tcp", "dns=0.0.0.0:15053"]
                    .iter()
                    .map(ToString::to_string)
                    .collect(),
            ),
            ..istio_proxy(1337, 1337, &to, &[])
        };
        let mut handle = clone_pod(pod);
        runtime
            .add_container(&mut handle, &extra, true)
            .expect("the DNS listener");
        runtime
            .connect_from(pod, "app", &dns)
            .assert_served_by(listener, &format!("{}'s app to port 53", pod.name));
    }

    // A revision the node has no ConfigMap for: refused, naming it; the others go on.
    let refused = runtime
        .run_pod(&PodSpec {
            name: "gone",
            namespace: "default",
            annotations: &[("sidecar.istio.io/status", &status("1-30"))],
            proxy: false,
        })
        .map(|p| p.id)
        .expect_err("no mesh configuration for revision 1-30");
    let text = refused.message().to_string();
    assert!(text.contains("ConfigMap istio-1-30"), "{text}");
    assert!(run(&runtime, "after", &status("canary"), false).is_some());
    let status = node.status();
    let revisions: Vec<&str> = status["mesh_configs"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|m| m["revision"].as_str())
        .collect();
    assert_eq!(revisions, ["default", "canary"], "{status:#}");
    drop(agent);
}

/// A second handle on the same pod (its containers are added by name).
fn clone_pod(pod: &CriPod) -> CriPod {
    CriPod {
        id: pod.id.clone(),
        name: pod.name.clone(),
        uid: pod.uid.clone(),
        ip: pod.ip.clone(),
        cgroup: pod.cgroup.clone(),
        netns: pod.netns.clone(),
        containers: pod.containers.clone(),
        config: pod.config.clone(),
    }
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario through containerd, its steps in the order they happen"
)]
fn the_proxy_containers_environment_and_uid_are_the_pods_settings() {
    let node = Node::new();
    node.install_cni();
    let runtime = Containerd::start(&node);
    let agent = node.start_agent_with(
        "auto",
        &[
            "--fallback",
            "iptables",
            // Not the variant the unsuffixed names run here: a rewrite must keep the pod's own.
            "--iptables-variant",
            "legacy",
            "--cri-socket",
            runtime.socket().to_str().unwrap(),
        ],
    );
    let Some(dest) = run(&runtime, "dest", "", false) else {
        return;
    };
    let (to, dns) = (format!("{}:8080", dest.ip), format!("{}:53", dest.ip));

    // The proxy's environment turns DNS capture on (a ProxyConfig resource, say): its app's DNS
    // goes to the DNS proxy, where ADD (no mesh file, no flag) had it captured to 15001.
    let Some(mut dns_pod) = run(&runtime, "dns-env", &status("default"), false) else {
        return;
    };
    let env = [("ISTIO_META_DNS_CAPTURE", "true")];
    runtime
        .add_container(&mut dns_pod, &istio_proxy(1337, 1337, &to, &env), true)
        .expect("the proxy");
    let r = wait_applied(&node, &dns_pod);
    let dns_setting = setting(&r, "dns_capture");
    assert_eq!(
        (
            dns_setting["value"].as_str(),
            dns_setting["source"].as_str()
        ),
        (Some("true"), Some("proxy_env")),
        "{r:#}"
    );
    runtime
        .connect_from(&dns_pod, "app", &dns)
        .assert_served_by("dns", "the app's DNS, under the proxy's DNS capture");
    runtime
        .connect_from(&dns_pod, "app", &to)
        .assert_served_by("outbound", "the app's other connections");

    // OpenShift: the proxy runs as the namespace's uid, with no annotation. It is the exempt one
    // (its first connection goes out, not back to itself), and an app container running as 1337
    // is captured.
    let Some(mut shift) = run(&runtime, "openshift", &status("default"), false) else {
        return;
    };
    let own = 1_000_680_000;
    runtime
        .add_container(&mut shift, &istio_proxy(own, own, &to, &[]), true)
        .expect("the proxy as its own uid");
    let r = wait_applied(&node, &shift);
    assert_eq!(r["config"]["proxy_uids"], serde_json::json!([own]), "{r:#}");
    // How soon after its start the proxy's first connection went out, and how many it had refused
    // before (each a connection captured back to itself while its uid was not known yet).
    let log = Containerd::container_log(&shift, "istio-proxy-0");
    let first = log
        .iter()
        .find(|l| l.starts_with("first connection after "))
        .unwrap_or_else(|| panic!("the proxy's log: {log:?}"));
    println!(
        "openshift pod: the proxy's {}",
        first.split(':').next().unwrap_or(first)
    );
    runtime
        .connect_from(&shift, "istio-proxy", &to)
        .assert_served_by("app", "the proxy's own connection goes where it asked");
    let as_1337 = Extra {
        name: "as-1337",
        image: PAUSE_IMAGE,
        uid: 1337,
        gid: 1337,
        groups: &[],
        command: None,
        attempt: 0,
        env: &[],
    };
    runtime
        .add_container(&mut shift, &as_1337, false)
        .expect("an app as 1337");
    runtime
        .connect_from(&shift, "as-1337", &to)
        .assert_served_by("outbound", "an app container running as 1337");

    // A pod on the rule backend (TPROXY): its rules are written again with DNS capture.
    let tproxy = [
        ("sidecar.istio.io/status", status("default")),
        ("sidecar.istio.io/interceptionMode", "TPROXY".to_string()),
    ];
    let annotations: Vec<(&str, &str)> = tproxy.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let mut rules_pod = runtime
        .run_pod(&PodSpec {
            name: "tproxy",
            namespace: "default",
            annotations: &annotations,
            proxy: false,
        })
        .expect("the TPROXY pod");
    let env = [("ISTIO_META_DNS_CAPTURE", "true")];
    runtime
        .add_container(&mut rules_pod, &istio_proxy(1337, 1337, &to, &env), true)
        .expect("the TPROXY pod's proxy");
    let r = wait_applied(&node, &rules_pod);
    assert_eq!(
        (r["mode"].as_str(), r["in_force"].as_bool()),
        (Some("iptables"), Some(true)),
        "{r:#}"
    );
    // Written again with the variant its record names (legacy), not the unsuffixed tools'.
    let legacy = capture_tests::guards::saved_rules(&rules_pod.netns, "legacy", &["-t", "nat"]);
    assert!(legacy.contains("-j ISTIO_OUTPUT_DNS"), "{legacy}");
    let nft = capture_tests::guards::saved_rules(&rules_pod.netns, "nft", &["-t", "nat"]);
    assert!(!nft.contains("ISTIO_"), "rules in the other variant: {nft}");

    // A variable that is no boolean: refused by name, the pod keeps ADD's settings.
    let Some(mut bad) = run(&runtime, "bad-env", &status("default"), false) else {
        return;
    };
    let env = [("ISTIO_META_DNS_CAPTURE", "yes")];
    runtime
        .add_container(&mut bad, &istio_proxy(1337, 1337, &to, &env), true)
        .expect("the proxy");
    let r = wait_applied(&node, &bad);
    let why = r["proxy_settings_refused"].as_str().unwrap_or_default();
    assert!(why.contains("ISTIO_META_DNS_CAPTURE=\"yes\""), "{r:#}");
    runtime
        .connect_from(&bad, "app", &dns)
        .assert_served_by("outbound", "DNS as ADD set it up");
    let shown = String::from_utf8_lossy(&node.capture(&["status"]).stdout).into_owned();
    assert!(
        shown.contains("REFUSED") && shown.contains("ISTIO_META_DNS_CAPTURE"),
        "{shown}"
    );
    let metrics = agent.checked_metrics();
    for result in ["applied", "refused"] {
        assert!(
            metrics.contains(&format!(
                "capture_proxy_settings_total{{result=\"{result}\"}}"
            )),
            "{result}: {metrics}"
        );
    }
}
