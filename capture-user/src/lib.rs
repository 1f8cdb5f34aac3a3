//! capture's node layer: the backends that put a pod's capture in place (ebpf, iptables,
//! nftables), Istio-rule detection, the operations the `capture` CLI and the node agent run
//! (attach, detach, repair, explain, trace, sockets), the runtime client and the CNI install.
//! Built on `capture-model` and `capture-sys` (docs/working-on/development.md, "Layers").

pub mod accel;
pub mod any_backend;
pub mod ebpf;
pub mod explain;
pub mod fallback;
pub mod identity;
pub mod install;
pub mod iptables;
pub mod istio_rules;
pub mod nftables;
pub mod node;
pub mod ops;
pub mod privileges;
pub mod probe;
pub mod proxy_settings;
pub mod runtime;
pub mod sockets;
pub mod test_hooks;
pub mod trace;
pub mod validate;

// The layers below, under the names this crate's code and its users know them by.
pub use capture_model::{api, backend, claims, cni, config, family, flavour, left_alone, record};
pub use capture_sys::{
    capabilities, cgroup, fsutil, lo_address, lock, netns, nf_tables, paths, pod_cgroup, sockdiag,
    socket_fds, userns,
};
