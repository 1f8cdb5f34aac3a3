//! Proxy identity by container with a real containerd and runc: the agent learns each pod's proxy
//! container from the runtime (its cgroup appears below the pod's, the runtime names it), so only
//! that container's proxy uid escapes capture; the app containers of the same pod are captured
//! whatever their uid, gid or groups, a restarted proxy is learned again, and a pod's own proxy
//! uid is honoured only where the node's annotation policy allows it.

use std::time::Duration;

use capture_tests::{
    cni::{Node, MESHED},
    containerd::{
        containers::Extra,
        image::{PAUSE_IMAGE, PROBE, PROXY_IMAGE},
        Containerd, CriPod, PodSpec,
    },
    guards::TempFile,
    wait::wait_until,
};

const BY_CONTAINER: (&str, &str) = ("capture.dev/proxy-identity", "container");
const OWN_UID: i64 = 1_000_680_000;
/// Proxy restarts in the test: each is learned again, and each is a sample of the delay.
const RESTARTS: u32 = 4;
const POLICY: &str = r#"
rules:
- name: openshift-uids
  namespaces: [openshift]
  annotations:
    capture.dev/proxy-uid: {ids: ["1000680000-1000689999"]}
"#;

/// The proxy: serves 15001/15006 once its first connection to `to` went through (retried every
/// 10 ms while refused), as a proxy reaches its control plane before it listens.
fn proxy(uid: i64, to: &str, attempt: u32) -> Extra<'static> {
    let command = [
        PROBE,
        "serve",
        "--dial-first",
        to,
        "--tcp",
        "outbound=0.0.0.0:15001",
        "--tcp",
        "inbound=0.0.0.0:15006",
    ];
    Extra {
        name: "istio-proxy",
        image: PROXY_IMAGE,
        uid,
        gid: uid,
        groups: &[],
        command: Some(command.iter().map(ToString::to_string).collect()),
        attempt,
        env: &[],
    }
}

fn idle(name: &'static str, uid: i64, gid: i64, groups: &'static [i64]) -> Extra<'static> {
    Extra {
        name,
        image: PAUSE_IMAGE,
        uid,
        gid,
        groups,
        command: None,
        attempt: 0,
        env: &[],
    }
}

/// How long the proxy's first connection took from its start, in ms, as its log says.
fn first_connection_ms(pod: &CriPod, attempt: u32) -> u64 {
    let log = Containerd::container_log(pod, &format!("istio-proxy-{attempt}"));
    let line = log
        .iter()
        .find_map(|l| l.strip_prefix("first connection after "))
        .unwrap_or_else(|| {
            panic!(
                "{}: the proxy's log has no first connection: {log:?}",
                pod.name
            )
        });
    line.split(' ').next().unwrap().parse().expect("ms")
}

/// A pod with only its app container, from the runtime; None where runc cannot start one here.
fn pod(
    runtime: &Containerd,
    name: &str,
    namespace: &str,
    annotations: &[(&str, &str)],
) -> Option<CriPod> {
    let spec = PodSpec {
        name,
        namespace,
        annotations,
        proxy: false,
    };
    runtime.run_pod_or_skip(&spec)
}

fn proxy_state(node: &Node, pod: &CriPod) -> serde_json::Value {
    node.status()["pods"]
        .as_array()
        .and_then(|pods| {
            pods.iter()
                .find(|p| p["pod"]["container_id"] == pod.id.as_str())
        })
        .map(|p| p["config"]["proxy_identity"]["proxy"].clone())
        .unwrap_or_default()
}

#[test]
#[expect(
    clippy::too_many_lines,
    reason = "one scenario through containerd, its steps in the order they happen"
)]
fn the_agent_learns_each_pods_proxy_container_and_exempts_it_alone() {
    let node = Node::new();
    node.install_cni();
    let policy = TempFile::new("policy.yaml", "rules: []");
    let runtime = Containerd::start(&node);
    let mut agent = node.start_agent_with(
        "ebpf",
        &[
            "--annotation-policy",
            policy.path.to_str().unwrap(),
            "--cri-socket",
            runtime.socket().to_str().unwrap(),
        ],
    );
    let Some(dest) = pod(&runtime, "dest", "default", &[]) else {
        return;
    };
    let to = format!("{}:8080", dest.ip);

    // By container: the proxy is learned before (or just after) its process runs.
    let Some(mut a) = pod(&runtime, "a", "default", &[MESHED[0], BY_CONTAINER]) else {
        return;
    };
    runtime
        .add_container(&mut a, &proxy(1337, &to, 0), true)
        .expect("the proxy");
    let first = first_connection_ms(&a, 0);
    assert_eq!(
        proxy_state(&node, &a)["state"],
        "known",
        "{}",
        node.status()
    );
    for extra in [
        idle("as-proxy-uid", 1337, 1000, &[]),
        idle("as-proxy-gid", 1000, 1337, &[]),
        idle("in-proxy-group", 1000, 1000, &[1337]),
    ] {
        runtime
            .add_container(&mut a, &extra, false)
            .expect(extra.name);
        let got = runtime.connect_from(&a, extra.name, &to);
        got.assert_served_by("outbound", &format!("a's {} container", extra.name));
        assert_eq!(got.orig(), Some(to.clone()), "{}", extra.name);
    }
    let got = runtime.connect_from(&a, "istio-proxy", &to);
    got.assert_served_by("app", "a's proxy goes where it asked");

    // The runtime restarts the proxy: a new container and cgroup, learned again each time; the
    // proxy's first connection goes through again (each restart one more sample of the delay).
    let mut delays = vec![first];
    for attempt in 1..=RESTARTS {
        runtime
            .remove_container(&mut a, "istio-proxy")
            .expect("stop the proxy");
        runtime
            .add_container(&mut a, &proxy(1337, &to, attempt), true)
            .expect("the restarted proxy");
        delays.push(first_connection_ms(&a, attempt));
        let got = runtime.connect_from(&a, "istio-proxy", &to);
        got.assert_served_by("app", &format!("a's proxy after restart {attempt}"));
    }
    delays.sort_unstable();
    println!("identity pod a: the proxy's first connection after {delays:?} ms (start and {RESTARTS} restarts)");
    let got = runtime.connect_from(&a, "as-proxy-uid", &to);
    got.assert_served_by("outbound", "a's uid-1337 app after the restarts");

    // The default is Istio's: an app container running as 1337 goes straight out.
    let Some(mut b) = pod(&runtime, "b", "default", MESHED) else {
        return;
    };
    runtime
        .add_container(&mut b, &proxy(1337, &to, 0), true)
        .expect("b's proxy");
    runtime
        .add_container(&mut b, &idle("as-proxy-uid", 1337, 1337, &[]), false)
        .expect("b's 1337 app");
    let got = runtime.connect_from(&b, "as-proxy-uid", &to);
    got.assert_served_by("app", "b (by uid): a 1337 app container goes direct");

    // A pod's own proxy uid: refused where the policy does not allow it, honoured where it does,
    // and the policy's change applies to the next pod without a restart.
    let own_uid = OWN_UID.to_string();
    let own = [
        MESHED[0],
        BY_CONTAINER,
        ("capture.dev/proxy-uid", own_uid.as_str()),
    ];
    let refused = runtime
        .run_pod(&PodSpec {
            name: "c",
            namespace: "openshift",
            annotations: &own,
            proxy: false,
        })
        .map(|p| p.id)
        .expect_err("no policy rule allows the pod's own uid yet");
    let text = refused.message().to_string();
    assert!(
        text.contains("capture.dev/proxy-uid") && text.contains("annotation policy"),
        "{text}"
    );
    policy.write(POLICY);
    let mut c = None;
    wait_until(
        Duration::from_secs(10),
        "the changed policy in force",
        || match runtime.run_pod(&PodSpec {
            name: "c",
            namespace: "openshift",
            annotations: &own,
            proxy: false,
        }) {
            Ok(pod) => {
                c = Some(pod);
                Ok(())
            }
            Err(e) => Err(e.message().to_string()),
        },
    );
    let mut c = c.expect("pod c");
    runtime
        .add_container(&mut c, &proxy(OWN_UID, &to, 0), true)
        .expect("c's proxy");
    runtime
        .add_container(&mut c, &idle("as-proxy-uid", OWN_UID, OWN_UID, &[]), false)
        .expect("c's app as the pod's proxy uid");
    let got = runtime.connect_from(&c, "istio-proxy", &to);
    got.assert_served_by("app", "c's proxy as its own uid");
    let got = runtime.connect_from(&c, "as-proxy-uid", &to);
    got.assert_served_by("outbound", "c's app as the pod's proxy uid");
    // Another namespace: the rule does not hold there.
    let elsewhere = runtime.run_pod(&PodSpec {
        name: "d",
        namespace: "default",
        annotations: &own,
        proxy: false,
    });
    assert!(
        elsewhere.is_err(),
        "the pod's own uid outside the rule's namespaces"
    );

    agent.stop();
}

#[test]
fn a_policy_that_cannot_be_read_keeps_a_starting_agent_unready_until_it_is_fixed() {
    let node = Node::new();
    let policy = TempFile::new("policy.yaml", "rules: [{name: x, annotations: {a: allow}}]");
    let agent = node.spawn_agent_of(
        &capture_tests::topology::capture_bin(),
        "ebpf",
        &["--annotation-policy", policy.path.to_str().unwrap()],
    );
    wait_until(
        Duration::from_mins(1),
        "the agent to blame the policy",
        || match agent.get("/readyz") {
            Some((503, body)) if body.contains("annotation policy") => Ok(()),
            other => Err(format!("{other:?}")),
        },
    );
    let (_, body) = agent.get("/readyz").expect("an answer");
    assert!(
        body.contains(policy.path.to_str().unwrap()),
        "names the file: {body}"
    );
    policy.write("rules: []");
    agent.wait_ready();
}
