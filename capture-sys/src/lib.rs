//! capture's system layer: what the kernel and the node offer any part of capture, with no
//! knowledge of pods' capture settings, backends or the agent. Every crate above may use it;
//! it uses none of them (docs/working-on/development.md, "Layers").

pub mod capabilities;
pub mod cgroup;
pub mod fsutil;
mod if_address;
pub mod lo_address;
pub mod lock;
mod netlink;
pub mod netns;
pub mod nf_tables;
pub mod paths;
pub mod pod_cgroup;
pub mod sockdiag;
pub mod socket_fds;
pub mod userns;
