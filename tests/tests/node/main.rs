//! Tier "node": the agent's bookkeeping over the same hooks. The chained CNI plugin, attach and
//! detach lifecycles, a live node's history, limits, upgrades and rollbacks, validate and the
//! node agent's image. It needs a kernel that attaches (the host runs it in CI, every kernel of
//! the matrix by hand), but its subject is capture's own state.

mod capabilities;
mod cgroup_v1;
mod cni;
mod explain;
mod identity_policy;
mod image;
mod istio_rules;
mod lifecycle;
mod limits;
mod live_node;
mod sizing;
mod sockets;
mod upgrade;
mod validate;
mod version;
