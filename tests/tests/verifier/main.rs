//! Tier "verifier": that every program of this build loads, passes the kernel's verifier and
//! attaches, as the feature probes see it, and that the netns cookie's two sources agree. The
//! smallest question a kernel must answer; CI asks it of every kernel of the matrix.

mod kernel_compat;
