//! capture's user space: pod configuration, the ebpf backend, and the operations the `capture`
//! CLI (and later the node agent and CNI plugin) run.

pub mod accel;
pub mod agent;
pub mod any_backend;
pub mod api;
pub mod backend;
pub mod cgroup;
pub mod claims;
pub mod cli;
pub mod cni;
pub mod config;
pub mod ebpf;
pub mod explain;
pub mod fallback;
pub mod fsutil;
pub mod identity;
pub mod install;
pub mod iptables;
pub mod istio_rules;
pub mod left_alone;
pub mod lock;
pub mod netns;
pub mod nftables;
pub mod ops;
pub mod paths;
pub mod probe;
pub mod proxy_settings;
pub mod record;
pub mod runtime;
pub mod sockdiag;
pub mod socket_fds;
pub mod sockets;
pub mod test_hooks;
pub mod trace;
pub mod userns;
pub mod validate;
