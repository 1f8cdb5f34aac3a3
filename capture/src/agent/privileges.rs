//! Whether this agent holds the capabilities its backends need (capture-user's `privileges`),
//! decided before anything is probed or loaded: without them the probe would only report what
//! they deny (`auto` would choose iptables for a node whose agent lacks `CAP_BPF`), and the
//! agent would serve half-able. What is missing keeps the agent not ready, saying so.

use capture_user::{
    capabilities::Capabilities,
    privileges,
    probe::{self, ModeChoice},
};

use super::options::AgentConfig;
use crate::record::Mode;

/// Why this agent cannot serve for want of privileges, or `None`.
pub(super) fn refusal(cfg: &AgentConfig) -> Option<String> {
    let ebpf = matches!(cfg.mode, ModeChoice::Ebpf | ModeChoice::Auto);
    let rules = cfg.mode != ModeChoice::Ebpf;
    let capabilities = privileges::refusal(&privileges::missing(
        &Capabilities::of_this_process(),
        ebpf,
        rules,
    ));
    let memlock = ebpf
        .then(|| {
            let release = capture_user::accel::kernel_release();
            privileges::raise_memlock(privileges::kernel_charges_memcg(&release)).err()
        })
        .flatten();
    match (capabilities, memlock) {
        (None, None) => None,
        (Some(why), None) | (None, Some(why)) => Some(why),
        (Some(capabilities), Some(memlock)) => Some(format!("{capabilities}; and {memlock}")),
    }
}

/// The mode asked for, standing in for the probe's choice while the agent cannot serve.
pub(super) fn requested(cfg: &AgentConfig) -> (probe::Probe, Mode, Option<Mode>) {
    let mode = match cfg.mode {
        ModeChoice::Ebpf | ModeChoice::Auto => Mode::Ebpf,
        ModeChoice::Iptables => Mode::Iptables,
        ModeChoice::Nftables => Mode::Nftables,
    };
    (probe::Probe::default(), mode, None)
}
