//! What this kernel can do for capture, found by trying (load-and-verify), not by version
//! numbers. The agent's `auto` mode and `capture doctor` use it.

use std::path::Path;

use serde::Serialize;

pub use crate::fallback::FallbackChoice;
use crate::{
    ebpf::{hook_probe, loader},
    record::Mode,
};

#[derive(Clone, Debug, Serialize)]
pub struct Check {
    pub name: String,
    pub ok: bool,
    pub detail: String,
    /// Only some pods need it: without it those pods fall back (auto) or are refused (ebpf),
    /// and the rest still use ebpf.
    pub optional: bool,
}

#[derive(Clone, Debug, Default, Serialize)]
pub struct Probe {
    pub kernel: String,
    pub checks: Vec<Check>,
    /// How the programs were adapted to this kernel (absent if they do not load at all).
    pub features: Option<loader::KernelFeatures>,
    /// Every check the ebpf backend needs for every pod passed (optional ones may have failed).
    pub ebpf_usable: bool,
    /// iptables-restore, ip6tables-restore and ip are installed.
    pub iptables_usable: bool,
    /// nft and ip are installed.
    pub nftables_usable: bool,
    /// What the node's own netns already holds, for `--fallback auto`.
    pub node_rules: crate::fallback::NodeRules,
}

impl Probe {
    /// Where `--fallback` sends a pod on this node, and why; or why nowhere.
    pub fn fallback(&self, choice: FallbackChoice) -> Result<(Mode, String), String> {
        crate::fallback::resolve(
            choice,
            self.iptables_usable,
            self.nftables_usable,
            &self.node_rules,
        )
    }

    /// Where a pod the ebpf backend cannot serve goes, when `--mode auto` chose ebpf for the
    /// node (`chosen`): `Ok(None)` in every other case (no pod falls back), `Err` when no
    /// fallback backend is usable here.
    pub fn pod_fallback(
        &self,
        choice: ModeChoice,
        chosen: Mode,
        fallback: FallbackChoice,
    ) -> Result<Option<(Mode, String)>, String> {
        if choice != ModeChoice::Auto || chosen != Mode::Ebpf {
            return Ok(None);
        }
        self.fallback(fallback).map(Some)
    }
}

fn check(name: impl Into<String>, result: Result<String, String>) -> Check {
    match result {
        Ok(detail) => Check {
            name: name.into(),
            ok: true,
            detail,
            optional: false,
        },
        Err(detail) => Check {
            name: name.into(),
            ok: false,
            detail,
            optional: false,
        },
    }
}

fn on_path(tool: &str) -> Result<String, String> {
    std::env::var_os("PATH")
        .and_then(|p| {
            std::env::split_paths(&p)
                .map(|d| d.join(tool))
                .find(|f| f.is_file())
        })
        .map(|f| f.display().to_string())
        .ok_or_else(|| format!("{tool} is not installed"))
}

/// Probes the running kernel and the node's tools.
#[must_use]
pub fn probe(iptables: &crate::iptables::flavour::NodeVariant) -> Probe {
    let kernel = nix::sys::utsname::uname().map_or_else(
        |_| "unknown".into(),
        |u| u.release().to_string_lossy().into_owned(),
    );
    let mut ebpf = vec![
        check(
            "cgroup v2",
            crate::cgroup::cgroup2_mount()
                .map(|p| format!("mounted at {}", p.display()))
                .map_err(|e| e.to_string()),
        ),
        check(
            "kernel BTF",
            if Path::new("/sys/kernel/btf/vmlinux").exists() {
                Ok("/sys/kernel/btf/vmlinux".into())
            } else {
                Err("/sys/kernel/btf/vmlinux is missing".into())
            },
        ),
        check(
            "netns cookie",
            crate::netns::describe_cookie_source(crate::ebpf::netns_cookie::netns_cookie),
        ),
    ];
    let (programs, features) = hook_probe::probe_programs();
    ebpf.extend(programs.into_iter().map(|(hook, result)| Check {
        optional: hook.dns_only,
        ..check(
            format!("program {}", hook.hook),
            result.map(|()| "loads, verifies and attaches".to_string()),
        )
    }));
    let ebpf_usable = ebpf.iter().all(|c| c.ok || c.optional);
    let tools: Vec<Check> = ["iptables-restore", "ip6tables-restore", "ip", "nft"]
        .into_iter()
        .map(|t| check(t, on_path(t)))
        .collect();
    let ok = |name: &str| tools.iter().any(|c| c.name == name && c.ok);
    let iptables_usable = ok("iptables-restore") && ok("ip6tables-restore") && ok("ip");
    let nftables_usable = ok("nft") && ok("ip");
    Probe {
        kernel,
        checks: ebpf.into_iter().chain(tools).collect(),
        features,
        ebpf_usable,
        iptables_usable,
        nftables_usable,
        node_rules: crate::fallback::NodeRules::of_this_netns(nftables_usable, iptables),
    }
}

/// The agent's `--mode`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ModeChoice {
    Ebpf,
    Iptables,
    Nftables,
    /// ebpf where the kernel supports every hook, else the `--fallback` backend.
    Auto,
}

/// Resolves a mode choice against a probe: the mode, and why. `fallback` is what `auto` falls
/// back to, for the node and per pod.
pub fn choose(
    choice: ModeChoice,
    fallback: FallbackChoice,
    probe: &Probe,
) -> Result<(Mode, String), String> {
    let failed: Vec<String> = probe
        .checks
        .iter()
        .filter(|c| {
            !c.ok && !["nft", "iptables-restore", "ip6tables-restore"].contains(&c.name.as_str())
        })
        .map(|c| format!("{}: {}", c.name, c.detail))
        .collect();
    let tools_failed = |names: &[&str]| {
        probe
            .checks
            .iter()
            .filter(|c| !c.ok && names.contains(&c.name.as_str()))
            .map(|c| format!("{}: {}", c.name, c.detail))
            .collect::<Vec<_>>()
            .join("; ")
    };
    let lacking: Vec<String> = probe
        .checks
        .iter()
        .filter(|c| !c.ok && c.optional)
        .map(|c| format!("{}: {}", c.name, c.detail))
        .collect();
    match choice {
        ModeChoice::Ebpf if probe.ebpf_usable => Ok((
            Mode::Ebpf,
            "requested, and the kernel supports every hook".into(),
        )),
        ModeChoice::Ebpf => Err(format!("--mode ebpf, but {}", failed.join("; "))),
        ModeChoice::Iptables if probe.iptables_usable => Ok((Mode::Iptables, "requested".into())),
        ModeChoice::Iptables => Err(format!(
            "--mode iptables, but {}",
            tools_failed(&["iptables-restore", "ip6tables-restore", "ip"])
        )),
        ModeChoice::Nftables if probe.nftables_usable => Ok((Mode::Nftables, "requested".into())),
        ModeChoice::Nftables => Err(format!(
            "--mode nftables, but {}",
            tools_failed(&["nft", "ip"])
        )),
        ModeChoice::Auto if probe.ebpf_usable && lacking.is_empty() => Ok((
            Mode::Ebpf,
            format!("auto: kernel {} supports every hook", probe.kernel),
        )),
        ModeChoice::Auto if probe.ebpf_usable => Ok((
            Mode::Ebpf,
            format!(
                "auto: ebpf, but pods that need what kernel {} lacks fall back ({})",
                probe.kernel,
                lacking.join("; ")
            ),
        )),
        ModeChoice::Auto => match probe.fallback(fallback) {
            Ok((mode, why)) => Ok((
                mode,
                format!(
                    "auto: falling back to {mode} ({why}) because {}",
                    failed.join("; ")
                ),
            )),
            Err(no) => Err(format!(
                "auto: the ebpf backend is not usable ({}), and {no}",
                failed.join("; ")
            )),
        },
    }
}
