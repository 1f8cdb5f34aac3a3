//! Tier "hooks": what the kernel answers. Every hook and both backends on real traffic (outbound,
//! inbound, DNS, interfaces, owners, TPROXY, user namespaces, the socket options, a real proxy's
//! view), the iptables variants and the acceleration's correctness suite. One module per subject;
//! CI runs this tier on every kernel of its matrix.

mod accel;
mod coexistence;
mod dns_and_groups;
mod haproxy;
mod interfaces;
mod iptables_variant;
mod multi_network;
mod nftables;
mod outbound;
mod owner_identity;
mod parity;
mod proxy_identity;
mod sockopt_answers;
mod stateless_redirect;
mod tproxy;
mod trace;
mod userns;
