//! What the node agent needs of the kernel's capabilities, operation by operation, and what a
//! process lacks of it. The DaemonSet adds exactly these to `drop: [ALL]`
//! (deploy/capture.yaml); docs/how-it-works/security.md is this table in prose, and the
//! capabilities test removes each in turn and watches the operation fail.
//!
//! An agent that lacks one refuses to become ready, naming it and what it is for, rather than
//! serving half-able: a missing `CAP_PERFMON`, say, would otherwise only switch the faster
//! programs off, and a missing `CAP_SYS_PTRACE` would fail only the first pod repaired in place.

use crate::capabilities::{Capabilities, Capability};

/// One capability and what needs it.
#[derive(Clone, Copy, Debug)]
pub struct Need {
    pub capability: Capability,
    /// A capability the kernel accepts instead (`CAP_SYS_ADMIN` for `CAP_BPF` and
    /// `CAP_PERFMON`, which split from it in 5.8): an agent that holds it needs not add this one.
    pub instead: Option<Capability>,
    /// The operations, in words an operator reads in `/readyz`.
    pub for_what: &'static str,
    /// Needed by the ebpf backend, by the rule backends, or both.
    pub ebpf: bool,
    pub rules: bool,
}

/// Every capability the agent needs, on kernels that know it.
pub const NEEDS: &[Need] = &[
    Need {
        capability: Capability::BPF,
        instead: Some(Capability::SYS_ADMIN),
        for_what: "bpf(): loading the kernel programs, creating and pinning their maps",
        ebpf: true,
        rules: false,
    },
    Need {
        capability: Capability::PERFMON,
        instead: Some(Capability::SYS_ADMIN),
        for_what: "the verifier's rules for programs that read kernel structures (a socket's \
                   owner, the stateless redirect) and compare sockets (the listener adopter)",
        ebpf: true,
        rules: false,
    },
    Need {
        capability: Capability::NET_ADMIN,
        instead: None,
        for_what: "attaching programs to pod cgroups and network namespaces, loading the \
                   listener adopter, and writing iptables and nftables rules in pod network \
                   namespaces",
        ebpf: true,
        rules: true,
    },
    Need {
        capability: Capability::NET_RAW,
        instead: None,
        for_what: "iptables' own raw sockets, in pod network namespaces (the iptables backend)",
        ebpf: false,
        rules: true,
    },
    Need {
        capability: Capability::SYS_ADMIN,
        instead: None,
        for_what: "entering pod network namespaces and the node's cgroup namespace (setns), \
                   and finding the node's kernel programs by id (status, takeover)",
        ebpf: true,
        rules: true,
    },
    Need {
        capability: Capability::DAC_OVERRIDE,
        instead: None,
        for_what: "creating the scratch cgroups of the kernel probe and of the netns-cookie \
                   reporter under a cgroup root its owner may not write (mode 555, as systemd \
                   mounts the unified hierarchy of a hybrid node), and listing the descriptors \
                   of other uids' processes (/proc/PID/fd, for `capture sockets`)",
        ebpf: true,
        rules: false,
    },
    Need {
        capability: Capability::SYS_PTRACE,
        instead: None,
        for_what: "opening other processes' namespaces through the node's /proc (the node's \
                   cgroup namespace, a netns named /proc/PID/ns/net), and taking a socket from \
                   the process that holds it (`capture sockets`)",
        ebpf: true,
        rules: true,
    },
];

/// The capabilities of `NEEDS` that `caps` lacks, for an agent running the ebpf backend, the
/// rule backends, or both. One the kernel accepts another for counts as held with the other; on
/// a kernel without `CAP_BPF` (before 5.8) only `CAP_SYS_ADMIN` is asked, as the kernel asks it.
#[must_use]
pub fn missing(caps: &Capabilities, ebpf: bool, rules: bool) -> Vec<Need> {
    NEEDS
        .iter()
        .filter(|n| (ebpf && n.ebpf) || (rules && n.rules))
        .filter(|n| caps.kernel_knows(n.capability) && !caps.has(n.capability))
        .filter(|n| !n.instead.is_some_and(|other| caps.has(other)))
        .copied()
        .collect()
}

/// The capabilities an agent container adds to `drop: [ALL]`: every need but those another of
/// them stands in for (deploy/capture.yaml's list, which a test compares with this).
#[must_use]
pub fn to_add() -> Vec<Capability> {
    let mut add: Vec<Capability> = NEEDS
        .iter()
        .filter(|n| n.instead.is_none())
        .map(|n| n.capability)
        .collect();
    add.sort();
    add.dedup();
    add
}

/// What `/readyz` and the log say of missing capabilities; `None` when none is missing.
#[must_use]
pub fn refusal(missing: &[Need]) -> Option<String> {
    if missing.is_empty() {
        return None;
    }
    let each: Vec<String> = missing
        .iter()
        .map(|n| format!("{} (for {})", n.capability, n.for_what))
        .collect();
    let names: Vec<String> = missing.iter().map(|n| n.capability.name()).collect();
    Some(format!(
        "missing {}; add {} to the agent container's securityContext.capabilities.add \
         (deploy/capture.yaml)",
        each.join("; "),
        names.join(", ")
    ))
}

/// What to add to a failed command's error where this process lacks capabilities the agent
/// holds: the kernel's refusal names none (`EPERM`, `EACCES`, or a tool's own words, such as
/// iptables-legacy's "unable to initialize table"). `None` for a process that lacks none, as in
/// the agent's container.
#[must_use]
pub fn hint() -> Option<String> {
    let lacking = missing(&Capabilities::of_this_process(), true, true);
    refusal(&lacking).map(|why| format!("this process is {why}"))
}

/// On kernels before 5.11 the kernel counts BPF memory against `RLIMIT_MEMLOCK`, which a
/// container's default leaves far too low for the node's maps: raise it to unlimited, or say
/// that `CAP_SYS_RESOURCE` is needed to. Later kernels charge the memory to the cgroup and
/// ignore the limit.
///
/// # Errors
/// The limit is low and cannot be raised.
pub fn raise_memlock(kernel_charges_memcg: bool) -> Result<(), String> {
    if kernel_charges_memcg {
        return Ok(());
    }
    let unlimited = libc::rlimit {
        rlim_cur: libc::RLIM_INFINITY,
        rlim_max: libc::RLIM_INFINITY,
    };
    // SAFETY: a plain setrlimit call with a valid struct.
    if unsafe { libc::setrlimit(libc::RLIMIT_MEMLOCK, &raw const unlimited) } == 0 {
        return Ok(());
    }
    let mut now = unlimited;
    // SAFETY: a plain getrlimit call into a valid struct.
    unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &raw mut now) };
    Err(format!(
        "missing {} (for raising RLIMIT_MEMLOCK, {} bytes here: on kernels before 5.11 the \
         kernel programs' maps count against it); add SYS_RESOURCE to the agent container's \
         securityContext.capabilities.add on such nodes",
        Capability::SYS_RESOURCE,
        now.rlim_cur
    ))
}

/// Whether the running kernel charges BPF memory to the memory cgroup (5.11 and later), from its
/// release (`uname -r`).
#[must_use]
pub fn kernel_charges_memcg(release: &str) -> bool {
    let mut parts = release
        .split(['.', '-'])
        .map(|p| p.parse::<u32>().unwrap_or(0));
    let (major, minor) = (parts.next().unwrap_or(0), parts.next().unwrap_or(0));
    (major, minor) >= (5, 11)
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: u64 = u64::MAX;

    #[test]
    fn an_agent_with_every_capability_misses_none() {
        let caps = Capabilities::new(ALL, 40);
        assert!(missing(&caps, true, true).is_empty());
        assert_eq!(refusal(&[]), None);
    }

    #[test]
    fn a_missing_capability_is_named_with_what_needs_it() {
        let caps = Capabilities::new(ALL & !(1 << Capability::DAC_OVERRIDE.0), 40);
        let gone = missing(&caps, true, false);
        assert_eq!(gone.len(), 1);
        let why = refusal(&gone).expect("a refusal");
        assert!(
            why.contains("CAP_DAC_OVERRIDE (for creating the scratch"),
            "{why}"
        );
        assert!(why.contains("add DAC_OVERRIDE to"), "{why}");
        // The rule backends do not need it.
        assert!(missing(&caps, false, true).is_empty());
    }

    #[test]
    fn sys_admin_stands_for_bpf_and_perfmon() {
        let without_bpf = ALL & !(1 << Capability::BPF.0) & !(1 << Capability::PERFMON.0);
        assert!(missing(&Capabilities::new(without_bpf, 37), true, true).is_empty());
        assert!(missing(&Capabilities::new(without_bpf, 40), true, true).is_empty());
        let without_any = without_bpf & !(1 << Capability::SYS_ADMIN.0);
        let names: Vec<_> = missing(&Capabilities::new(without_any, 40), true, false)
            .iter()
            .map(|n| n.capability)
            .collect();
        assert_eq!(
            names,
            [Capability::BPF, Capability::PERFMON, Capability::SYS_ADMIN]
        );
        assert!(!to_add().contains(&Capability::BPF));
        assert!(to_add().contains(&Capability::SYS_ADMIN));
    }

    #[test]
    fn memcg_charging_starts_at_5_11() {
        assert!(!kernel_charges_memcg("5.10.0-32-amd64"));
        assert!(kernel_charges_memcg("5.11.0"));
        assert!(kernel_charges_memcg("6.1.0-50-amd64"));
        assert!(kernel_charges_memcg("6.18.0"));
        assert!(raise_memlock(true).is_ok());
    }
}
