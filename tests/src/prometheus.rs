//! A real Prometheus server (Debian's `prometheus`, installed by `cargo xtask setup` for promtool)
//! started by a test: its own configuration, database directory and loopback port, scraping the
//! targets the test names every second; killed and removed on drop. Queries go through its HTTP
//! API, as a dashboard's would.

use std::{
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Command, Stdio},
    time::Duration,
};

use serde_json::Value;

use crate::agent::http_request;

/// The running server.
pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    pub addr: SocketAddr,
}

/// One sample of an instant vector: its labels and value.
#[derive(Debug)]
pub struct Sample {
    pub labels: serde_json::Map<String, Value>,
    pub value: f64,
}

impl Prometheus {
    /// Starts a server that scrapes `/metrics` of each of `targets` every second (job
    /// `capture`), and waits until it is ready to answer queries.
    #[must_use]
    pub fn start(targets: &[SocketAddr]) -> Self {
        let dir = std::env::temp_dir().join(crate::unique("capture-prometheus"));
        std::fs::create_dir_all(&dir).expect("the Prometheus directory");
        let targets: Vec<String> = targets.iter().map(|t| format!("\"{t}\"")).collect();
        let config = format!(
            "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n\
             scrape_configs:\n  - job_name: capture\n    static_configs:\n      - targets: [{}]\n",
            targets.join(", ")
        );
        std::fs::write(dir.join("prometheus.yml"), config).expect("the Prometheus configuration");
        let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
        let addr = free.local_addr().expect("its address");
        drop(free);
        let mut cmd = Command::new("prometheus");
        cmd.arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={addr}"))
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let child = cmd.spawn().unwrap_or_else(|e| {
            panic!("running prometheus: {e}; `cargo xtask setup` installs it (Debian package prometheus)")
        });
        let mut server = Self { child, dir, addr };
        crate::wait::wait_until(Duration::from_mins(2), "prometheus to be ready", || {
            if let Ok(Some(status)) = server.child.try_wait() {
                panic!("prometheus exited ({status}) before it was ready");
            }
            match http_request(addr, "GET", "/-/ready") {
                Some(r) if r.code == 200 => Ok(()),
                Some(r) => Err(format!("{} {}", r.code, r.body)),
                None => Err("no answer".into()),
            }
        });
        server
    }

    /// Evaluates `expr` now (the instant-query API).
    #[must_use]
    pub fn query(&self, expr: &str) -> Vec<Sample> {
        let path = format!("/api/v1/query?query={}", percent_encoded(expr));
        let resp = http_request(self.addr, "GET", &path).expect("querying prometheus");
        assert_eq!(resp.code, 200, "{expr}: {}", resp.body);
        let answer: Value = serde_json::from_str(&resp.body)
            .unwrap_or_else(|e| panic!("{expr}: {e} in {}", resp.body));
        assert_eq!(answer["status"], "success", "{expr}: {answer}");
        assert_eq!(answer["data"]["resultType"], "vector", "{expr}: {answer}");
        answer["data"]["result"]
            .as_array()
            .expect("a vector")
            .iter()
            .map(|s| Sample {
                labels: s["metric"].as_object().cloned().unwrap_or_default(),
                value: s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or_else(|| panic!("{expr}: a sample without a value: {s}")),
            })
            .collect()
    }

    /// Queries `expr` until `done` accepts the answer; panics with the last one after `timeout`.
    pub fn wait_for(
        &self,
        expr: &str,
        timeout: Duration,
        done: impl Fn(&[Sample]) -> bool,
    ) -> Vec<Sample> {
        crate::wait::wait_until(
            timeout,
            &format!("{expr} to give what was expected"),
            || {
                let samples = self.query(expr);
                if done(&samples) {
                    Ok(samples)
                } else {
                    Err(format!("{samples:?}"))
                }
            },
        )
    }

    /// The last scrape error of each target (empty when it scraped cleanly).
    #[must_use]
    pub fn target_errors(&self) -> Vec<String> {
        let resp = http_request(self.addr, "GET", "/api/v1/targets").expect("prometheus targets");
        let answer: Value = serde_json::from_str(&resp.body).expect("targets JSON");
        answer["data"]["activeTargets"]
            .as_array()
            .expect("active targets")
            .iter()
            .map(|t| t["lastError"].as_str().unwrap_or_default().to_string())
            .collect()
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `s` as a URL query value: every byte but the unreserved ones as `%XX`.
fn percent_encoded(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'.' | b'_' | b'~' => {
                char::from(b).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}
