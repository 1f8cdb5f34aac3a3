//! This process's Linux capabilities, as the kernel reports them (`/proc/self/status`), and
//! which of them the running kernel knows (`/proc/sys/kernel/cap_last_cap`): a kernel before 5.8
//! has no `CAP_BPF` or `CAP_PERFMON`, and asks `CAP_SYS_ADMIN` where later ones ask those.

use std::fs;

/// A capability, by its number in `linux/capability.h`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Capability(pub u8);

impl Capability {
    pub const DAC_OVERRIDE: Self = Self(1);
    pub const NET_ADMIN: Self = Self(12);
    pub const NET_RAW: Self = Self(13);
    pub const SYS_PTRACE: Self = Self(19);
    pub const SYS_ADMIN: Self = Self(21);
    pub const SYS_RESOURCE: Self = Self(24);
    pub const PERFMON: Self = Self(38);
    pub const BPF: Self = Self(39);

    /// The name a Kubernetes `securityContext.capabilities` list uses (`NET_ADMIN`).
    #[must_use]
    pub fn name(self) -> String {
        match NAMES.iter().find(|(n, _)| *n == self.0) {
            Some((_, name)) => (*name).to_string(),
            None => format!("capability {}", self.0),
        }
    }
}

impl std::fmt::Display for Capability {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "CAP_{}", self.name())
    }
}

/// The names of the capabilities capture asks about, and of those a manifest might add.
const NAMES: &[(u8, &str)] = &[
    (0, "CHOWN"),
    (1, "DAC_OVERRIDE"),
    (2, "DAC_READ_SEARCH"),
    (3, "FOWNER"),
    (12, "NET_ADMIN"),
    (13, "NET_RAW"),
    (14, "IPC_LOCK"),
    (19, "SYS_PTRACE"),
    (21, "SYS_ADMIN"),
    (24, "SYS_RESOURCE"),
    (38, "PERFMON"),
    (39, "BPF"),
];

/// The capabilities a process holds, and those its kernel knows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Capabilities {
    effective: u64,
    last_known: u8,
}

impl Capabilities {
    /// This process's effective set. A kernel that does not say (no `/proc`) is taken to grant
    /// everything: the operations themselves then say what they lack.
    #[must_use]
    pub fn of_this_process() -> Self {
        let effective = fs::read_to_string("/proc/self/status")
            .ok()
            .and_then(|status| parse_effective(&status))
            .unwrap_or(u64::MAX);
        let last_known = fs::read_to_string("/proc/sys/kernel/cap_last_cap")
            .ok()
            .and_then(|s| s.trim().parse().ok())
            .unwrap_or(Capability::BPF.0);
        Self {
            effective,
            last_known,
        }
    }

    #[must_use]
    pub const fn new(effective: u64, last_known: u8) -> Self {
        Self {
            effective,
            last_known,
        }
    }

    #[must_use]
    pub fn has(&self, cap: Capability) -> bool {
        cap.0 < 64 && self.effective & (1 << cap.0) != 0
    }

    /// Whether the running kernel knows `cap` (`CAP_BPF` and `CAP_PERFMON` since 5.8).
    #[must_use]
    pub fn kernel_knows(&self, cap: Capability) -> bool {
        cap.0 <= self.last_known
    }
}

/// The `CapEff:` line of a `/proc/PID/status`.
fn parse_effective(status: &str) -> Option<u64> {
    let hex = status.lines().find_map(|l| l.strip_prefix("CapEff:"))?;
    u64::from_str_radix(hex.trim(), 16).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_effective_set_is_read_from_the_status_file() {
        let status = "Name:\tcapture\nCapInh:\t0000000000000000\nCapEff:\t000000c000203000\n";
        let caps = Capabilities::new(parse_effective(status).unwrap(), 40);
        for cap in [
            Capability::NET_ADMIN,
            Capability::NET_RAW,
            Capability::SYS_ADMIN,
            Capability::PERFMON,
            Capability::BPF,
        ] {
            assert!(caps.has(cap), "{cap}");
        }
        assert!(!caps.has(Capability::SYS_PTRACE));
        assert!(!caps.has(Capability::DAC_OVERRIDE));
    }

    #[test]
    fn a_kernel_before_5_8_knows_no_cap_bpf() {
        let caps = Capabilities::new(u64::MAX, 37);
        assert!(!caps.kernel_knows(Capability::BPF));
        assert!(caps.kernel_knows(Capability::SYS_ADMIN));
        assert_eq!(Capability::BPF.to_string(), "CAP_BPF");
        assert_eq!(Capability(40).name(), "capability 40");
    }

    #[test]
    fn this_process_has_a_readable_set() {
        let caps = Capabilities::of_this_process();
        assert!(caps.kernel_knows(Capability::SYS_ADMIN));
    }
}
