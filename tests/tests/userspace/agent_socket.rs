//! The agent's Unix socket against clients that misbehave: not root, too much, too slow, too
//! many. Each is turned away with an answer that says why, and root's requests are served
//! meanwhile.

use std::{
    io::{BufRead as _, BufReader, Read as _, Write as _},
    os::unix::{fs::PermissionsExt as _, net::UnixStream, process::CommandExt as _},
    process::Command,
    time::{Duration, Instant},
};

use capture_tests::{cni::Node, wait::wait_until};
use serde_json::Value;

/// Sends `request` on a new connection and reads the one-line answer.
fn ask(node: &Node, request: &[u8]) -> Value {
    let mut s = UnixStream::connect(&node.socket).expect("connecting to the agent socket");
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    // A client turned away may be answered (and closed) before its request is in.
    let _ = s.write_all(request);
    answer(s)
}

fn answer(s: UnixStream) -> Value {
    let mut line = String::new();
    BufReader::new(s)
        .read_line(&mut line)
        .expect("reading the answer");
    serde_json::from_str(&line).unwrap_or_else(|e| panic!("{e}: {line:?}"))
}

fn error_of(answer: &Value) -> &str {
    assert_eq!(answer["ok"], false, "{answer}");
    answer["error"].as_str().unwrap_or_default()
}

const STATUS: &[u8] = b"{\"op\":\"status\"}\n";

#[test]
fn only_root_may_use_the_socket_even_when_its_mode_lets_others_in() {
    let node = Node::new();
    let _agent = node.start_agent("iptables");
    // A mount or an operator that loosened the socket's mode.
    std::fs::set_permissions(&node.socket, std::fs::Permissions::from_mode(0o666)).unwrap();
    let script = "import socket, sys\n\
                  s = socket.socket(socket.AF_UNIX)\n\
                  s.connect(sys.argv[1])\n\
                  try: s.sendall(b'{\"op\":\"status\"}\\n')\n\
                  except BrokenPipeError: pass\n\
                  print(s.makefile().readline(), end='')\n";
    let out = Command::new("python3")
        .args(["-c", script])
        .arg(&node.socket)
        .uid(65534)
        .gid(65534)
        .output()
        .expect("python3");
    let said = String::from_utf8_lossy(&out.stdout);
    let answer: Value =
        serde_json::from_str(&said).unwrap_or_else(|e| panic!("{e}: {said:?} {out:?}"));
    let error = error_of(&answer);
    assert!(
        error.contains("only root") && error.contains("65534"),
        "{error}"
    );
    assert_eq!(ask(&node, STATUS)["ok"], true, "root is still served");
}

#[test]
fn an_oversized_request_is_refused_and_the_agent_serves_on() {
    let node = Node::new();
    let _agent = node.start_agent("iptables");
    let mut s = UnixStream::connect(&node.socket).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let writer = {
        let mut s = s.try_clone().unwrap();
        std::thread::spawn(move || {
            // Two MiB without a newline; the agent stops reading after one.
            let chunk = vec![b'a'; 64 * 1024];
            for _ in 0..32 {
                if s.write_all(&chunk).is_err() {
                    break;
                }
            }
        })
    };
    let mut line = String::new();
    BufReader::new(&mut s).read_line(&mut line).unwrap();
    let answer: Value = serde_json::from_str(&line).unwrap();
    assert!(error_of(&answer).contains("longer than"), "{answer}");
    drop(s);
    writer.join().unwrap();
    assert_eq!(ask(&node, STATUS)["ok"], true);
}

#[test]
fn silent_clients_are_dropped_and_do_not_hold_up_others() {
    let node = Node::new();
    let _agent = node.start_agent("iptables");
    let silent = UnixStream::connect(&node.socket).unwrap();
    silent
        .set_read_timeout(Some(Duration::from_secs(30)))
        .unwrap();
    let start = Instant::now();
    assert_eq!(
        ask(&node, STATUS)["ok"],
        true,
        "served next to a silent client"
    );
    assert!(
        start.elapsed() < Duration::from_secs(3),
        "{:?}",
        start.elapsed()
    );
    let answer = answer(silent);
    assert!(error_of(&answer).contains("no request line"), "{answer}");
    let waited = start.elapsed();
    assert!(
        waited >= Duration::from_secs(4) && waited < Duration::from_secs(20),
        "dropped after {waited:?}"
    );
}

#[test]
fn clients_beyond_the_limit_are_told_to_come_back() {
    let node = Node::new();
    let _agent = node.start_agent("iptables");
    // Hold every slot with clients that send nothing.
    let holders: Vec<UnixStream> = (0..64)
        .map(|_| UnixStream::connect(&node.socket).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let answer = ask(&node, STATUS);
    let error = error_of(&answer);
    assert!(error.contains("try again"), "{answer}");
    assert_eq!(
        answer["kind"], "not_ready",
        "capture-cni makes it 'try again later'"
    );
    drop(holders);
    wait_until(Duration::from_secs(30), "the agent to serve again", || {
        let mut s = UnixStream::connect(&node.socket).unwrap();
        let _ = s.write_all(STATUS);
        let mut said = String::new();
        let _ = s.read_to_string(&mut said);
        if said.contains("\"ok\":true") {
            Ok(())
        } else {
            Err(said)
        }
    });
}
