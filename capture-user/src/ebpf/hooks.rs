//! The hooks capture links: which program goes to which attach point of the pod's cgroup or
//! netns, in which order, and which of them only DNS capture needs.

use aya_obj::generated::bpf_attach_type::{
    BPF_CGROUP_GETSOCKOPT, BPF_CGROUP_INET4_CONNECT, BPF_CGROUP_INET4_GETPEERNAME,
    BPF_CGROUP_INET4_GETSOCKNAME, BPF_CGROUP_INET6_CONNECT, BPF_CGROUP_INET6_GETPEERNAME,
    BPF_CGROUP_INET6_GETSOCKNAME, BPF_CGROUP_INET_SOCK_CREATE, BPF_CGROUP_SOCK_OPS,
    BPF_CGROUP_UDP4_RECVMSG, BPF_CGROUP_UDP4_SENDMSG, BPF_CGROUP_UDP6_RECVMSG,
    BPF_CGROUP_UDP6_SENDMSG, BPF_SK_LOOKUP,
};

use crate::config::CaptureConfig;

/// What a program is linked to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Target {
    /// The pod's cgroup v2 directory.
    Cgroup,
    /// The pod's network namespace.
    Netns,
}

/// One program and the hook it attaches to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Hook {
    /// The program's name in the object (its function name).
    pub program: &'static str,
    /// The kernel's `enum bpf_attach_type` value.
    pub attach_type: u32,
    /// The hook as people call it.
    pub hook: &'static str,
    pub target: Target,
    /// Only pods with DNS capture need it (UDP hooks run on every datagram).
    pub dns_only: bool,
}

impl Hook {
    /// Whether a pod with `cfg` needs this hook. A kernel without a hook only some pods need
    /// still serves the others with ebpf.
    #[must_use]
    pub fn needed_by(&self, cfg: &CaptureConfig) -> bool {
        !self.dns_only || cfg.dns.is_some()
    }
}

/// The hooks added since node records list the programs their build pinned: a record without
/// that list (an older build's) pinned every hook of `HOOKS` but these. (Hooks added later are
/// missing from the lists of the builds before them, as they should be.)
pub const HOOKS_ADDED_SINCE_LISTED: [&str; 2] = ["capture_getsockname4", "capture_getsockname6"];

/// A hook the node's kernel refused. Only hooks that some pods can do without may be missing;
/// the others make the whole ebpf backend unusable.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct UnavailableHook {
    pub hook: String,
    pub reason: String,
}

/// In attach order: everything the proxy needs (creator tracking, the hand-off, the answers,
/// listener registration) is in place before `sk_lookup` and connect4/6 start steering. Detach runs
/// in reverse, so steering stops first.
pub const HOOKS: [Hook; 14] = [
    Hook {
        program: "capture_sock_create",
        attach_type: BPF_CGROUP_INET_SOCK_CREATE as u32,
        hook: "cgroup/sock_create",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_sock_ops",
        attach_type: BPF_CGROUP_SOCK_OPS as u32,
        hook: "sock_ops",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getsockopt",
        attach_type: BPF_CGROUP_GETSOCKOPT as u32,
        hook: "cgroup/getsockopt",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getpeername4",
        attach_type: BPF_CGROUP_INET4_GETPEERNAME as u32,
        hook: "cgroup/getpeername4",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getpeername6",
        attach_type: BPF_CGROUP_INET6_GETPEERNAME as u32,
        hook: "cgroup/getpeername6",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getsockname4",
        attach_type: BPF_CGROUP_INET4_GETSOCKNAME as u32,
        hook: "cgroup/getsockname4",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_getsockname6",
        attach_type: BPF_CGROUP_INET6_GETSOCKNAME as u32,
        hook: "cgroup/getsockname6",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_recvmsg4",
        attach_type: BPF_CGROUP_UDP4_RECVMSG as u32,
        hook: "cgroup/recvmsg4",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_recvmsg6",
        attach_type: BPF_CGROUP_UDP6_RECVMSG as u32,
        hook: "cgroup/recvmsg6",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_sk_lookup",
        attach_type: BPF_SK_LOOKUP as u32,
        hook: "sk_lookup",
        target: Target::Netns,
        dns_only: false,
    },
    Hook {
        program: "capture_sendmsg4",
        attach_type: BPF_CGROUP_UDP4_SENDMSG as u32,
        hook: "cgroup/sendmsg4",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_sendmsg6",
        attach_type: BPF_CGROUP_UDP6_SENDMSG as u32,
        hook: "cgroup/sendmsg6",
        target: Target::Cgroup,
        dns_only: true,
    },
    Hook {
        program: "capture_connect4",
        attach_type: BPF_CGROUP_INET4_CONNECT as u32,
        hook: "cgroup/connect4",
        target: Target::Cgroup,
        dns_only: false,
    },
    Hook {
        program: "capture_connect6",
        attach_type: BPF_CGROUP_INET6_CONNECT as u32,
        hook: "cgroup/connect6",
        target: Target::Cgroup,
        dns_only: false,
    },
];
