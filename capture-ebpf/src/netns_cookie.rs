//! Tells user space the netns cookie of a network namespace on kernels without
//! `SO_NETNS_COOKIE` (before Linux 5.14). The node agent attaches this program to a private,
//! short-lived cgroup and has a child process, inside that cgroup and the pod's netns, create one
//! socket; the program records the cookie in the one slot of a map only that load of the object
//! has. (Not under the child's pid: the kernel gives the pid of the initial PID namespace, which
//! an agent in a PID namespace of its own does not know.)
#![no_std]
#![no_main]

use aya_ebpf::{
    btf_maps::HashMap,
    helpers::generated::bpf_get_netns_cookie,
    macros::{btf_map, cgroup_sock},
    programs::SockContext,
    EbpfContext as _,
};

/// The object's license, as the kernel reads it: that of the kernel crate (see main.rs).
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// The slot the cookie is recorded in (the map is the reporter's own, its cgroup the child's).
const SLOT: u32 = 0;

/// The netns cookie of the socket the child created, in [`SLOT`].
#[btf_map]
static NETNS_COOKIES: HashMap<u32, u64, 1> = HashMap::new();

#[cgroup_sock(sock_create)]
pub fn report_netns_cookie(ctx: SockContext) -> i32 {
    // SAFETY: a plain helper call, permitted in cgroup sock programs since Linux 5.7.
    let cookie = unsafe { bpf_get_netns_cookie(ctx.as_ptr()) };
    let _ = NETNS_COOKIES.insert(SLOT, cookie, 0);
    // The socket is created either way.
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
