//! The iptables backend: Istio's own rules (spec section B), generated from the same validated
//! configuration as the ebpf backend. It is the reference for the parity tests, the fallback for
//! kernels that lack a hook, and the baseline for benchmarks.

pub mod apply;
pub mod rules;
