//! The `capture` binary's two faces over capture's node layer (`capture-user`): the command line
//! (`cli`) and the node agent (`agent`), which the CLI's `agent` command runs.

pub mod agent;
pub mod build_info;
pub mod cli;

// The layers below, under the names this crate's code uses.
use capture_model::{api, claims, cni, config, left_alone, record};
use capture_sys::{cgroup, fsutil, netns, paths, pod_cgroup, sockdiag};
use capture_user::{
    accel, ebpf, explain, identity, install, ops, probe, proxy_settings, runtime, sockets, trace,
    validate,
};
