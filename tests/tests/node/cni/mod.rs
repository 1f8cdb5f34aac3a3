//! The node agent and the chained CNI plugin end to end: a real conflist (bridge + host-local,
//! then capture-cni) run as a runtime runs it, real traffic, fail-closed behaviour, restarts.

use capture_tests::{
    cni::{error_code as code, CgroupDriver, Node, Pod, MESHED},
    probe::{connect_with, Outcome},
    topology::{cgroup_programs, pinned_map_len, pod_pins_left, POD_CGROUP_HOOKS},
};
use std::time::Duration;

use serde_json::json;

mod goldens;
mod istio;
mod mesh;
mod spawns;

/// Connects from the node netns to `ip:port`.
pub(crate) fn from_node(node: &Node, ip: &str, port: u16) -> Outcome {
    connect_with(node.client(), &format!("{ip}:{port}"))
}

#[test]
fn add_captures_pods_and_del_leaves_nothing() {
    let node = Node::new();
    let _agent = node.start_agent("ebpf");
    let mut a = node.pod("a", CgroupDriver::Cgroupfs, MESHED);
    let mut b = node.pod("b", CgroupDriver::Systemd, MESHED);
    node.add(&mut a).expect("ADD a");
    node.add(&mut b).expect("ADD b");
    let _servers = [a.start_servers(), b.start_servers()];

    // Inbound: a client outside the pod reaches the pod's inbound listener with the original port.
    let got = from_node(&node, a.ip(), 8080);
    got.assert_served_by("inbound", "");
    assert_eq!(got.orig(), Some(format!("{}:8080", a.ip())));
    // Outbound: pod a's app calling pod b lands on a's own proxy.
    let got = connect_with(a.app_client(), &format!("{}:8080", b.ip()));
    got.assert_served_by("outbound", "");
    assert_eq!(got.orig(), Some(format!("{}:8080", b.ip())));

    node.check(&a).expect("CHECK a");
    node.check(&b).expect("CHECK b");
    assert_eq!(cgroup_programs(&a.cgroup).len(), POD_CGROUP_HOOKS);

    node.del(&a).expect("DEL a");
    node.del(&b).expect("DEL b");
    for pod in [&a, &b] {
        assert!(
            cgroup_programs(&pod.cgroup).is_empty(),
            "{} still has programs",
            pod.name
        );
    }
    for map in [
        "POD_CONFIGS",
        "POD_COUNTERS",
        "PORT_LISTS",
        "INBOUND_PODS",
        "INBOUND_LISTENERS",
        "HANDOFF",
        "LOOPBACK_DESTS",
    ] {
        assert_eq!(
            pinned_map_len(&node.dirs.bpffs, map),
            0,
            "{map} keeps entries after DEL"
        );
    }
    assert!(!pod_pins_left(&node.dirs.bpffs), "link pins left");
    // DEL is idempotent.
    node.del(&a).expect("second DEL a");
}

#[test]
fn agent_down_fails_add_closed() {
    let node = Node::new();
    let mut pod = node.pod("lonely", CgroupDriver::Cgroupfs, MESHED);
    let err = node
        .add(&mut pod)
        .expect_err("ADD without an agent must fail");
    assert_eq!(code(&err), Some(11), "{err}");
    assert!(
        err["error"]["details"].as_str().unwrap().contains("agent"),
        "{err}"
    );
    assert!(cgroup_programs(&pod.cgroup).is_empty());

    // A stale file where the socket should be: a configuration error naming it.
    std::fs::create_dir_all(&node.dirs.state).unwrap();
    std::fs::write(&node.socket, "not a socket").unwrap();
    let mut pod2 = node.pod("stale", CgroupDriver::Cgroupfs, MESHED);
    let err = node
        .add(&mut pod2)
        .expect_err("ADD with a non-socket must fail");
    assert_eq!(code(&err), Some(7), "{err}");
    assert!(
        err["error"]["details"]
            .as_str()
            .unwrap()
            .contains("is not a socket"),
        "{err}"
    );
}

#[test]
fn killed_agent_lets_nothing_escape_and_the_restarted_agent_adopts() {
    let node = Node::new();
    let mut agent = node.start_agent("ebpf");
    let mut pod = node.pod("survivor", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut pod).expect("ADD");
    let _servers = pod.start_servers();
    // Traffic keeps flowing, in both directions, while the agent is killed and restarted: every
    // connection must land on the proxy.
    let stop = std::sync::atomic::AtomicBool::new(false);
    let mut late = node.pod("late", CgroupDriver::Cgroupfs, MESHED);
    let landed = std::thread::scope(|s| {
        let flow = s.spawn(|| {
            let mut landed = Vec::new();
            while !stop.load(std::sync::atomic::Ordering::Relaxed) {
                landed.push(from_node(&node, pod.ip(), 8080).server());
                landed.push(connect_with(pod.app_client(), "10.88.0.1:9").server());
            }
            landed
        });
        std::thread::sleep(Duration::from_millis(200));
        agent.kill_hard();
        std::thread::sleep(Duration::from_millis(300));
        // New pods fail closed meanwhile.
        assert_eq!(code(&node.add(&mut late).expect_err("no agent")), Some(11));
        let restarted = node.start_agent("ebpf");
        std::thread::sleep(Duration::from_millis(200));
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        (flow.join().unwrap(), restarted)
    });
    let (landed, _agent) = landed;
    assert!(
        landed.len() >= 10,
        "too little traffic to judge: {}",
        landed.len()
    );
    for pair in landed.chunks(2) {
        assert_eq!(
            pair[0].as_deref(),
            Some("inbound"),
            "an inbound connection escaped: {landed:?}"
        );
        assert_eq!(
            pair[1].as_deref(),
            Some("outbound"),
            "an outbound connection escaped: {landed:?}"
        );
    }

    node.check(&pod).expect("CHECK after restart");
    node.add(&mut late).expect("ADD after restart");
    node.del(&pod).expect("DEL after restart");
    node.del(&late).expect("DEL late");
    assert!(cgroup_programs(&pod.cgroup).is_empty());
}

#[test]
fn pods_that_are_not_meshed_are_left_alone() {
    let node = Node::new();
    let _agent = node.start_agent("ebpf");
    let mut plain = node.pod("plain", CgroupDriver::Cgroupfs, &[]);
    let mut opted_out = node.pod(
        "opted-out",
        CgroupDriver::Cgroupfs,
        &[MESHED[0], ("sidecar.istio.io/inject", "false")],
    );
    let mut system = node.pod("dns", CgroupDriver::Systemd, MESHED);
    system.namespace = "kube-system".into();
    for pod in [&mut plain, &mut opted_out, &mut system] {
        node.add(pod)
            .unwrap_or_else(|e| panic!("ADD {}: {e}", pod.name));
        assert!(
            cgroup_programs(&pod.cgroup).is_empty(),
            "{} was captured",
            pod.name
        );
        node.check(pod)
            .unwrap_or_else(|e| panic!("CHECK {}: {e}", pod.name));
    }
    let _servers = plain.start_servers();
    let got = from_node(&node, plain.ip(), 8080);
    got.assert_served_by("app", "");
    for pod in [&plain, &opted_out, &system] {
        node.del(pod).expect("DEL");
    }
}

#[test]
fn bad_input_gets_a_cni_error_and_attaches_nothing() {
    let node = Node::new();
    let _agent = node.start_agent("ebpf");
    let pod = node.pod("bad", CgroupDriver::Cgroupfs, MESHED);
    let list = node.conflist();
    let prev = json!({"cniVersion": "1.0.0", "ips": [{"address": "10.88.0.50/24"}]});
    let good = node.plugin_conf(&list, 1, &pod, Some(&prev));

    let cases: Vec<(&str, serde_json::Value, Option<&str>, u64, &str)> = vec![
        (
            "no prevResult",
            node.plugin_conf(&list, 1, &pod, None),
            None,
            7,
            "prevResult",
        ),
        (
            "unknown cniVersion",
            {
                let mut c = good.clone();
                c["cniVersion"] = json!("9.9.9");
                c
            },
            None,
            1,
            "9.9.9",
        ),
        (
            "missing CNI_ARGS",
            good.clone(),
            Some("IgnoreUnknown=1"),
            4,
            "K8S_POD_NAMESPACE",
        ),
        (
            "no pod cgroup",
            good.clone(),
            Some("K8S_POD_NAMESPACE=default;K8S_POD_NAME=x;K8S_POD_UID=no-such-uid"),
            102,
            "no-such-uid",
        ),
        (
            "unknown plugin key",
            {
                let mut c = good.clone();
                c["agent_sockt"] = json!("/x");
                c
            },
            None,
            7,
            "agent_sockt",
        ),
        (
            "no annotations capability",
            {
                let mut c = good.clone();
                c.as_object_mut().unwrap().remove("runtimeConfig");
                c
            },
            None,
            7,
            "capabilities",
        ),
    ];
    for (what, conf, args, want, needle) in cases {
        let err = node.exec_plugin("ADD", &pod, &conf, args).expect_err(what);
        assert_eq!(code(&err), Some(want), "{what}: {err}");
        let text = err["error"].to_string();
        assert!(
            text.contains(needle),
            "{what}: {text} does not mention {needle}"
        );
    }
    // Malformed and truncated stdin.
    for stdin in ["{not json", &good.to_string()[..40]] {
        let err = node
            .exec_raw("ADD", &pod, "capture-cni", stdin, None)
            .expect_err("malformed stdin");
        assert_eq!(code(&err), Some(6), "{stdin}: {err}");
    }
    assert!(
        cgroup_programs(&pod.cgroup).is_empty(),
        "bad input attached something"
    );
}

#[test]
fn status_and_gc() {
    let node = Node::new();
    let mut agent = node.start_agent("ebpf");
    let mut keep = node.pod("keep", CgroupDriver::Cgroupfs, MESHED);
    let mut gone = node.pod("gone", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut keep).expect("ADD keep");
    node.add(&mut gone).expect("ADD gone");
    node.capture_cni_v11("STATUS", &keep, json!({}))
        .expect("STATUS with a ready agent");

    // GC: the runtime says only `keep` is still attached.
    let valid = json!({"cni.dev/valid-attachments": [{"containerID": keep.container_id, "ifname": "eth0"}]});
    node.capture_cni_v11("GC", &keep, valid).expect("GC");
    assert!(
        cgroup_programs(&gone.cgroup).is_empty(),
        "GC left the stale pod captured"
    );
    assert_eq!(
        cgroup_programs(&keep.cgroup).len(),
        POD_CGROUP_HOOKS,
        "GC released a valid pod"
    );

    // Metrics name the pods and count the attaches.
    let body = agent.checked_metrics();
    assert!(body.contains("capture_pods 1"), "{body}");
    assert!(body.contains("capture_mode{mode=\"ebpf\"} 1"), "{body}");
    assert!(
        body.contains("capture_attach_duration_seconds_count 2"),
        "{body}"
    );
    // And the two ADDs as the plugin saw them, from its start.
    assert!(
        body.contains("capture_cni_add_duration_seconds_count{mode=\"ebpf\",result=\"ok\"} 2"),
        "{body}"
    );
    assert!(body.contains(&format!("pod=\"{}\"", keep.name)), "{body}");

    agent.stop();
    let err = node
        .capture_cni_v11("STATUS", &keep, json!({}))
        .expect_err("STATUS without an agent");
    assert_eq!(code(&err), Some(50), "{err}");
    let _agent = node.start_agent("ebpf");
    node.del(&keep).expect("DEL keep");
    node.del(&gone).expect("DEL gone (already collected)");
    let _: &Pod = &gone;
}

#[test]
fn install_cni_chains_a_working_plugin() {
    let node = Node::new();
    // install-cni replaces the symlinked binary with a copy and chains itself after the bridge.
    std::fs::remove_file(node.plugin_dir.join("capture-cni")).unwrap();
    let list = node.install_cni();
    assert_eq!(list["plugins"][1]["type"], "capture-cni", "{list}");
    assert_eq!(
        list["plugins"][1]["agent_socket"],
        json!(node.socket),
        "{list}"
    );
    let _agent = node.start_agent("ebpf");
    let mut pod = node.pod("installed", CgroupDriver::Systemd, MESHED);
    node.add(&mut pod)
        .expect("ADD through the installed conflist");
    assert_eq!(cgroup_programs(&pod.cgroup).len(), POD_CGROUP_HOOKS);
    node.del(&pod).expect("DEL");
}

#[test]
fn older_spec_versions_work_too() {
    // Calico, Flannel and kindnet ship 0.3.1 conflists, the AWS VPC CNI 0.4.0.
    for version in ["0.3.1", "0.4.0"] {
        let node = Node::new();
        let _agent = node.start_agent("ebpf");
        let mut list = node.conflist();
        list["cniVersion"] = json!(version);
        *node.installed_conflist() = Some(list);
        let mut pod = node.pod("legacy", CgroupDriver::Cgroupfs, MESHED);
        node.add(&mut pod)
            .unwrap_or_else(|e| panic!("ADD with {version}: {e}"));
        assert_eq!(
            cgroup_programs(&pod.cgroup).len(),
            POD_CGROUP_HOOKS,
            "{version}"
        );
        if version == "0.3.1" {
            // CHECK arrived with 0.4.0: for a 0.3.1 network the plugin refuses it, per the spec.
            let err = node.check(&pod).expect_err("CHECK on 0.3.1");
            assert_eq!(code(&err), Some(1), "{err}");
        } else {
            node.check(&pod)
                .unwrap_or_else(|e| panic!("CHECK with {version}: {e}"));
        }
        node.del(&pod)
            .unwrap_or_else(|e| panic!("DEL with {version}: {e}"));
        assert!(cgroup_programs(&pod.cgroup).is_empty(), "{version}");
    }
}

#[test]
fn the_agent_in_iptables_mode() {
    let node = Node::new();
    let mut agent = node.start_agent("iptables");
    let mut pod = node.pod("legacy-kernel", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut pod).expect("ADD");
    let _servers = pod.start_servers();
    assert!(
        cgroup_programs(&pod.cgroup).is_empty(),
        "iptables mode attaches no programs"
    );
    let got = from_node(&node, pod.ip(), 8080);
    got.assert_served_by("inbound", "");
    assert_eq!(
        got.server_local(),
        Some(format!("{}:15006", pod.ip())),
        "REDIRECT rewrites the local address"
    );
    node.check(&pod).expect("CHECK");
    let body = agent.checked_metrics();
    assert!(body.contains("capture_mode{mode=\"iptables\"} 1"), "{body}");
    node.del(&pod).expect("DEL");
    let rules = std::process::Command::new("nsenter")
        .arg(format!("--net={}", pod.netns.path().display()))
        .args(["iptables-save", "-t", "nat"])
        .output()
        .unwrap();
    assert!(
        !String::from_utf8_lossy(&rules.stdout).contains("ISTIO"),
        "DEL left rules behind"
    );
    agent.stop();
}

#[test]
fn auto_mode_falls_back_per_pod_and_says_so() {
    let node = Node::new();
    let agent = node.start_agent("auto");
    let annotations = [MESHED[0], ("sidecar.istio.io/interceptionMode", "TPROXY")];
    let mut tproxy = node.pod("tproxy", CgroupDriver::Cgroupfs, &annotations);
    let mut plain = node.pod("plain", CgroupDriver::Cgroupfs, MESHED);
    node.add(&mut tproxy).expect("ADD tproxy");
    node.add(&mut plain).expect("ADD plain");
    assert!(
        cgroup_programs(&tproxy.cgroup).is_empty(),
        "the TPROXY pod runs on iptables"
    );
    assert_eq!(
        cgroup_programs(&plain.cgroup).len(),
        POD_CGROUP_HOOKS,
        "the other pod stays on ebpf"
    );
    let body = agent.checked_metrics();
    // The probe behind the mode is on show: every hook was loaded, verified and attached.
    for hook in ["sock_ops", "sk_lookup", "cgroup/connect4"] {
        let line = format!("capture_kernel_check{{check=\"program {hook}\",optional=\"false\"}} 1");
        assert!(body.contains(&line), "{line} missing from\n{body}");
    }
    let fallback: Vec<&str> = body
        .lines()
        .filter(|l| l.starts_with("capture_pod_fallback{"))
        .collect();
    assert_eq!(fallback.len(), 1, "{body}");
    assert!(
        fallback[0].contains("pod=\"tproxy\"") && fallback[0].contains("cause=\"tproxy\""),
        "{}",
        fallback[0]
    );
    node.check(&tproxy).expect("CHECK tproxy");
    node.del(&tproxy).expect("DEL tproxy");
    node.del(&plain).expect("DEL plain");
}

#[test]
fn the_http_endpoint_answers_its_routes() {
    let node = Node::new();
    let agent = node.start_agent("iptables");
    for (method, path, code, body) in [
        ("GET", "/healthz", 200, "ok\n"),
        ("GET", "/readyz", 200, "ready\n"),
        (
            "GET",
            "/metrics/x",
            404,
            "try /healthz, /readyz or /metrics\n",
        ),
        ("POST", "/healthz", 405, "only GET\n"),
        // An answer to HEAD has no body, whatever its status.
        ("HEAD", "/metrics", 405, ""),
    ] {
        let resp = agent
            .request(method, path)
            .unwrap_or_else(|| panic!("no answer to {method} {path}"));
        assert_eq!(
            (resp.code, resp.body.as_str()),
            (code, body),
            "{method} {path}"
        );
        if code == 405 {
            assert_eq!(resp.header("allow"), Some("GET"), "{}", resp.head);
        }
    }
    let metrics = agent.checked_metrics();
    assert!(
        metrics.lines().any(|l| l == "capture_agent_ready 1"),
        "{metrics}"
    );
}

#[test]
fn silent_http_clients_are_dropped_while_others_are_served() {
    use std::io::{Read as _, Write as _};
    use std::time::{Duration, Instant};

    let node = Node::new();
    let agent = node.start_agent("iptables");
    let opened = Instant::now();
    let mut stalled: Vec<_> = (0..20).map(|_| agent.connect()).collect();
    stalled[0].write_all(b"GET /heal").unwrap();
    stalled[1]
        .write_all(b"GET /healthz HTTP/1.1\r\nHost: loc")
        .unwrap();

    // While they hold their connections, other clients are answered.
    for _ in 0..5 {
        assert_eq!(agent.get("/healthz"), Some((200, "ok\n".into())));
    }
    assert!(agent.checked_metrics().contains("capture_agent_ready 1"));

    // Then the agent closes every stalled connection, without an answer, once the header read
    // timeout has passed (with slack for a slow machine).
    let timeout = capture::agent::HEADER_READ_TIMEOUT;
    let limit = timeout + Duration::from_secs(5);
    for (i, stream) in stalled.iter_mut().enumerate() {
        stream
            .set_read_timeout(Some(
                limit
                    .saturating_sub(opened.elapsed())
                    .max(Duration::from_millis(1)),
            ))
            .unwrap();
        let mut got = Vec::new();
        match stream.read_to_end(&mut got) {
            Ok(_) => assert!(got.is_empty(), "client {i} got {:?}", String::from_utf8_lossy(&got)),
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => {}
            Err(e) => panic!(
                "client {i} still connected after {:?} ({e}); the header read timeout is {timeout:?}",
                opened.elapsed()
            ),
        }
    }
    let took = opened.elapsed();
    assert!(
        took >= timeout.checked_sub(Duration::from_millis(500)).unwrap(),
        "stalled clients dropped after {took:?}, before the {timeout:?} timeout"
    );
    assert_eq!(agent.get("/healthz"), Some((200, "ok\n".into())));
}
