//! Tier "userspace": capture's user space, whatever the kernel. Malformed input, the agent's
//! socket protocol, the CNI defaults, the container runtime's calls, the DaemonSet manifest, the
//! metrics, the alerts and the dashboard on them, the rule backends' rules against Istio's own rule tests. What these ask of the kernel the other tiers ask too, so the
//! kernel matrix leaves them to the host's run (`cargo xtask test`).

mod agent_socket;
mod alerts;
mod bad_input;
mod cni_defaults;
mod cni_fight;
mod containerd;
mod daemonset;
mod dashboard;
mod deploy;
mod istio_goldens;
mod prometheus;
mod proxy_identity;
mod proxy_settings;
mod reconcile;
mod release;
