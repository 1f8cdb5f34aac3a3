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

use crate::{
    agent::{http_request, Agent},
    cni::Node,
};

/// How long a series may take to reach a query: a scrape every second, with room for a loaded
/// machine.
pub const SCRAPED: Duration = Duration::from_mins(1);

/// The running server.
pub struct Prometheus {
    child: Child,
    dir: PathBuf,
    pub addr: SocketAddr,
    targets: usize,
}

/// One sample of an instant vector: its labels and value.
#[derive(Debug)]
pub struct Sample {
    pub labels: serde_json::Map<String, Value>,
    pub value: f64,
}

impl Prometheus {
    /// Starts a server that scrapes `/metrics` of each of `targets` every second (job
    /// `capture`), and waits until it is ready to answer queries. Its first scrape comes about
    /// five seconds later (Prometheus hands new targets to its scrapers every five seconds):
    /// a test that starts it before its targets has them scraped sooner.
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
        let addr = free_loopback_addr();
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
        let mut server = Self {
            child,
            dir,
            addr,
            targets: targets.len(),
        };
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
        self.try_query(expr).unwrap_or_else(|e| panic!("{e}"))
    }

    /// Evaluates `expr` now; Err with what Prometheus said when it does not answer an instant
    /// vector without error or warning, as a dashboard's panel would show it.
    ///
    /// # Errors
    /// An expression Prometheus refuses or warns about, or whose answer is not a vector.
    pub fn try_query(&self, expr: &str) -> Result<Vec<Sample>, String> {
        let path = format!("/api/v1/query?query={}", percent_encoded(expr));
        let resp = http_request(self.addr, "GET", &path).expect("querying prometheus");
        let answer: Value = serde_json::from_str(&resp.body)
            .map_err(|e| format!("{expr}: {e} in {} {}", resp.code, resp.body))?;
        if resp.code != 200 || answer["status"] != "success" {
            return Err(format!("{expr}: {} {answer}", resp.code));
        }
        if answer.get("warnings").is_some() {
            return Err(format!("{expr}: warned: {answer}"));
        }
        if answer["data"]["resultType"] != "vector" {
            return Err(format!("{expr}: not an instant vector: {answer}"));
        }
        answer["data"]["result"]
            .as_array()
            .ok_or_else(|| format!("{expr}: no result in {answer}"))?
            .iter()
            .map(|s| {
                let value = s["value"][1]
                    .as_str()
                    .and_then(|v| v.parse().ok())
                    .ok_or_else(|| format!("{expr}: a sample without a value: {s}"))?;
                Ok(Sample {
                    labels: s["metric"].as_object().cloned().unwrap_or_default(),
                    value,
                })
            })
            .collect()
    }

    /// Waits until Prometheus has scraped every target it was started with.
    pub fn wait_scraped(&self) {
        self.wait_for("up{job=\"capture\"}", SCRAPED, |s| {
            s.len() == self.targets && s.iter().all(|s| s.value > 0.0)
        });
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

/// A loopback address nothing listens on now, for a listener a test is about to start.
#[must_use]
pub fn free_loopback_addr() -> SocketAddr {
    let free = std::net::TcpListener::bind("127.0.0.1:0").expect("a free port");
    free.local_addr().expect("its address")
}

/// The node's agent in `mode` with `extra` arguments and its metrics-only listener on `metrics`
/// (`--metrics`, as deploy/capture.yaml serves it to Prometheus), once ready.
#[must_use]
pub fn start_agent_with_metrics(
    node: &Node,
    metrics: SocketAddr,
    mode: &str,
    extra: &[&str],
) -> Agent {
    let metrics = metrics.to_string();
    let mut args = vec!["--metrics", metrics.as_str()];
    args.extend(extra);
    node.start_agent_with(mode, &args)
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
