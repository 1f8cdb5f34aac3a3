//! Whether the Istio rules a pod's netns holds are exactly what a rule backend would write for
//! it. The backend writes its rules into a scratch netns of its own, and both are listed by the
//! same tool: what the kernel holds is compared, not how two writers spelled it.

use std::{path::Path, process::Command};

use serde_json::Value;

use super::{run, Found, IPTABLES_TABLES};
use crate::{
    config::CaptureConfig, iptables::rules::Family, nftables::rules::TABLES as NFT_TABLES,
    record::Mode,
};

/// `Ok(None)` when they are identical, else `Ok(Some(how they differ))`.
pub fn identical(
    netns: &Path,
    cfg: &CaptureConfig,
    mode: Mode,
    found: &Found,
) -> Result<Option<String>, String> {
    match mode {
        Mode::Ebpf => Ok(Some("the ebpf backend writes no rules".into())),
        Mode::Iptables if !found.nftables.is_empty() => Ok(Some(format!(
            "nftables tables {} are there too",
            found.nftables.join(", ")
        ))),
        Mode::Nftables if !found.iptables.is_empty() => {
            Ok(Some("iptables chains are there too".into()))
        }
        Mode::Iptables => {
            let Some(flavour) = found.iptables_flavour() else {
                return Ok(Some("both iptables variants hold Istio chains".into()));
            };
            let scratch = ScratchNetns::new()?;
            crate::iptables::apply::apply(scratch.path(), cfg, flavour)
                .map_err(|e| e.to_string())?;
            for family in [Family::V4, Family::V6] {
                for table in IPTABLES_TABLES {
                    let save = |ns: &Path| {
                        let tool = flavour.tool(family, false);
                        saved_rules(
                            &run(ns, Command::new(tool).args(["-t", table])).unwrap_or_default(),
                        )
                    };
                    let (theirs, ours) = (save(netns), save(scratch.path()));
                    if theirs != ours {
                        return Ok(Some(format!(
                            "{} -t {table} differs from what capture writes for this pod",
                            flavour.tool(family, false)
                        )));
                    }
                }
            }
            Ok(None)
        }
        Mode::Nftables => {
            let scratch = ScratchNetns::new()?;
            crate::nftables::apply::apply(scratch.path(), cfg).map_err(|e| e.to_string())?;
            for table in NFT_TABLES {
                let list = |ns: &Path| {
                    let out = run(
                        ns,
                        Command::new("nft").args(["-j", "list", "table", "inet", table]),
                    );
                    out.ok()
                        .and_then(|o| serde_json::from_str::<Value>(&o).ok())
                        .map(normalized)
                };
                if list(netns) != list(scratch.path()) {
                    return Ok(Some(format!(
                        "table inet {table} differs from what capture writes for this pod"
                    )));
                }
            }
            Ok(None)
        }
    }
}

/// A table's chains and rules as `-save` prints them, without packet counters or comments.
fn saved_rules(saved: &str) -> Vec<String> {
    saved
        .lines()
        .filter(|l| l.starts_with(':') || l.starts_with("-A "))
        .map(|l| match l.rsplit_once(" [") {
            Some((chain, _counters)) if l.starts_with(':') => chain.to_owned(),
            _ => l.to_owned(),
        })
        .collect()
}

/// An `nft -j` listing without what differs between two copies of one ruleset: handles, the
/// counters' values and nft's version.
fn normalized(mut listing: Value) -> Value {
    fn strip(v: &mut Value) {
        match v {
            Value::Object(map) => {
                map.remove("handle");
                map.remove("metainfo");
                if let Some(Value::Object(counter)) = map.get_mut("counter") {
                    counter.remove("packets");
                    counter.remove("bytes");
                }
                map.values_mut().for_each(strip);
            }
            Value::Array(items) => {
                items.iter_mut().for_each(strip);
                items.retain(|i| i.as_object().is_none_or(|o| !o.is_empty()));
            }
            _ => {}
        }
    }
    strip(&mut listing);
    listing
}

/// A network namespace of capture's own, deleted on drop.
struct ScratchNetns {
    name: String,
    path: std::path::PathBuf,
}

impl ScratchNetns {
    fn new() -> Result<Self, String> {
        use std::sync::atomic::{AtomicU32, Ordering};
        static NEXT: AtomicU32 = AtomicU32::new(0);
        let name = format!(
            "capture-scratch-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        );
        let out = Command::new("ip")
            .args(["netns", "add", &name])
            .output()
            .map_err(|e| format!("ip netns add {name}: {e}; install iproute2"))?;
        if !out.status.success() {
            return Err(format!(
                "ip netns add {name}: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        let path = Path::new("/var/run/netns").join(&name);
        Ok(Self { name, path })
    }

    fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for ScratchNetns {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["netns", "del", &self.name])
            .output();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn saved_rules_leave_out_counters_and_comments() {
        let saved = "# Generated by iptables-nft-save\n*nat\n:PREROUTING ACCEPT [3:180]\n:ISTIO_OUTPUT - [0:0]\n-A OUTPUT -j ISTIO_OUTPUT\nCOMMIT\n";
        assert_eq!(
            saved_rules(saved),
            [
                ":PREROUTING ACCEPT",
                ":ISTIO_OUTPUT -",
                "-A OUTPUT -j ISTIO_OUTPUT"
            ]
        );
    }

    #[test]
    fn listings_compare_without_handles_or_counts() {
        let a = serde_json::json!({"nftables": [{"metainfo": {"version": "1.0.6"}},
            {"rule": {"handle": 4, "expr": [{"counter": {"packets": 9, "bytes": 540}}]}}]});
        let b = serde_json::json!({"nftables": [{"metainfo": {"version": "1.1.1"}},
            {"rule": {"handle": 7, "expr": [{"counter": {"packets": 0, "bytes": 0}}]}}]});
        assert_eq!(normalized(a), normalized(b));
    }
}
