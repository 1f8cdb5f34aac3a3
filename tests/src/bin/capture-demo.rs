//! `cargo xtask demo`: capture a pod's real traffic in under a minute.
//!
//! Builds a pod (netns + cgroup) wired to a "remote" netns, attaches capture, starts a proxy
//! (uid 1337) on 15001 and an app (uid 1000) that connects to a remote address, shows where the
//! connection landed and what the proxy learned, prints `capture status`, and cleans up.

use capture_tests::{
    probe::Who,
    topology::{Topology, POD_IP4, POD_IP6},
};

fn step(text: &str) {
    println!("\n==> {text}");
}

fn show(topo: &Topology, who: &Who, to: &str) {
    let got = topo.tcp(who, to);
    let role = if who.uid == 1337 {
        "proxy (uid 1337)"
    } else {
        "app (uid 1000)"
    };
    match got.server().as_deref() {
        Some("outbound") => println!(
            "    {role} connect({to}) -> accepted by the PROXY on 15001 from {}; SO_ORIGINAL_DST = {}; the app still sees peer {}",
            got.peer_seen().unwrap_or_default(),
            got.orig().unwrap_or_default(),
            got.client_peer().unwrap_or_default()
        ),
        Some("remote") => println!("    {role} connect({to}) -> went DIRECT to the remote host (accepted on {})", got.server_local().unwrap_or_default()),
        other => println!("    {role} connect({to}) -> {other:?} {:?}", got.0),
    }
}

fn main() {
    step("creating a pod: netns + cgroup v2, veth to a remote netns that owns 10.0.0.0/16 and fd00:2::/64");
    let mut topo = Topology::new();
    println!(
        "    pod netns {}  cgroup {}  ips {POD_IP4}, {POD_IP6}",
        topo.pod.netns.path().display(),
        topo.pod.cgroup.path.display()
    );

    step("capture attach (the programs load once, attach to the pod's cgroup, and stay pinned after the CLI exits)");
    topo.attach(&[]);
    let out = topo.capture(&["status"]);
    print!("{}", String::from_utf8_lossy(&out.stdout));

    step("starting the remote servers, the proxy (uid 1337, 15001/15006) and the app (uid 1000) in the pod");
    topo.start_all();

    step("the app connects out: every TCP connection goes to the proxy first");
    show(&topo, &Who::app(), "10.0.0.5:80");
    show(&topo, &Who::app(), "[fd00:2::5]:80");
    step("the proxy's own connections are exempt (uid 1337), so it can reach the real destination");
    show(&topo, &Who::proxy(), "10.0.0.5:80");

    step("capture status");
    let out = topo.capture(&["status"]);
    print!("{}", String::from_utf8_lossy(&out.stdout));

    step("capture detach: the same connection now goes direct");
    let out = topo.detach();
    print!("{}", String::from_utf8_lossy(&out.stdout));
    show(&topo, &Who::app(), "10.0.0.5:80");

    step("cleaning up the pod, the remote and the pins");
    drop(topo);
    println!("    done: netns, cgroup and pins removed");
}
