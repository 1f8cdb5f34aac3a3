//! capture's model: what a pod's capture is, apart from how a backend puts it in place. A pod's
//! configuration from its annotations and its mesh's settings (`config`), which pods istio-cni
//! would capture (`cni`), the node's records of captured pods (`record`), claims and left-alone
//! pods, the backend trait, and the agent's socket API. capture-cni links this crate and
//! `capture-sys` only (docs/working-on/development.md, "Layers").

pub mod api;
pub mod backend;
pub mod claims;
pub mod cni;
pub mod config;
pub mod family;
pub mod flavour;
pub mod left_alone;
pub mod record;

// The system layer's modules, under the names this crate's code uses.
use capture_sys::{cgroup, fsutil, netns, paths};
