//! Tells user space the netns cookie of a network namespace on kernels without
//! `SO_NETNS_COOKIE` (before Linux 5.14). The node agent attaches this program to a private,
//! short-lived cgroup and has a child process, inside that cgroup and the pod's netns, create one
//! socket; the program records the cookie under the child's pid.
#![no_std]
#![no_main]

use aya_ebpf::{
    btf_maps::HashMap,
    helpers::generated::{bpf_get_current_pid_tgid, bpf_get_netns_cookie},
    macros::{btf_map, cgroup_sock},
    programs::SockContext,
    EbpfContext as _,
};

/// Concurrent lookups on one node (each entry is read and dropped with the object).
const MAX_LOOKUPS: usize = 64;

/// Process id -> the netns cookie of the socket it created.
#[btf_map]
static NETNS_COOKIES: HashMap<u32, u64, MAX_LOOKUPS> = HashMap::new();

#[cgroup_sock(sock_create)]
pub fn report_netns_cookie(ctx: SockContext) -> i32 {
    // SAFETY: plain helper calls, both permitted in cgroup sock programs since Linux 5.7.
    let (pid_tgid, cookie) = unsafe {
        (
            bpf_get_current_pid_tgid(),
            bpf_get_netns_cookie(ctx.as_ptr()),
        )
    };
    let _ = NETNS_COOKIES.insert((pid_tgid >> 32) as u32, cookie, 0);
    // The socket is created either way.
    1
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
