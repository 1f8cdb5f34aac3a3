//! Registers a listener that predates its pod's attach, from inside the kernel: for an agent that
//! cannot take the proxy's descriptor (no `pidfd_open` across PID namespaces). User space runs
//! this traffic-control program with `BPF_PROG_TEST_RUN` on a thread inside the pod's netns; the
//! test packet carries one `AdoptRequest` and receives one `AdoptAnswer`
//! (`capture_common::adopt`). The maps are the node's own: the loader points both at their pins.
//!
//! Traffic-control programs may look a socket up by address, hold it, and put it into a sockhash
//! (Linux 5.10) or give it socket-local storage, without any socket lock held around them, which
//! a TCP iterator (the other way to reach every socket of a netns) does hold.
#![no_std]
#![no_main]

mod socket_states;

use aya_ebpf::{
    bindings::{
        bpf_map_type::BPF_MAP_TYPE_SOCKHASH, bpf_sock, bpf_sock_tuple, BPF_F_CURRENT_NETNS,
        BPF_NOEXIST, BPF_SK_STORAGE_GET_F_CREATE, TC_ACT_OK,
    },
    cty::c_void,
    helpers::generated::{
        bpf_map_lookup_elem, bpf_map_update_elem, bpf_sk_lookup_tcp, bpf_sk_release,
        bpf_sk_storage_get,
    },
    macros::{btf_map, classifier},
    programs::TcContext,
    EbpfContext as _,
};
use capture_common::{
    adopt::{
        AdoptAnswer, AdoptRequest, ACTION_INBOUND, ACTION_OUTBOUND, ANSWER_OFFSET, OUTCOME_ALREADY,
        OUTCOME_BAD_REQUEST, OUTCOME_MAP_REFUSED, OUTCOME_NOT_FOUND, OUTCOME_NO_STATE,
        OUTCOME_REGISTERED, OUTCOME_SLOTS_FULL, REQUEST_OFFSET,
    },
    keys::{ListenerKey, LISTENER_SLOTS},
    layout::MAX_INBOUND_LISTENERS,
    state::{SockState, SOCK_INBOUND_LISTENER, SOCK_NETNS_KNOWN},
    AF_INET,
};

use crate::socket_states::SocketStates;

/// The object's license, as the kernel reads it: that of the kernel crate (see main.rs).
#[link_section = "license"]
#[no_mangle]
static LICENSE: [u8; 13] = *b"Dual MIT/GPL\0";

/// `TCP_LISTEN` from the kernel's `tcp_states.h`.
const TCP_LISTEN: u32 = 10;

/// The node's listener map (capture-ebpf's `INBOUND_LISTENERS`), declared by hand: the helpers
/// below take the map itself, which `btf_maps::SockHash` does not give out.
#[repr(C)]
pub struct Listeners {
    r#type: *const [i32; BPF_MAP_TYPE_SOCKHASH as usize],
    key: *const ListenerKey,
    value: *const u32,
    max_entries: *const [i32; MAX_INBOUND_LISTENERS as usize],
    map_flags: *const [i32; 0],
}

// SAFETY: the fields are type-only placeholders the loader reads from BTF; nothing dereferences them.
unsafe impl Sync for Listeners {}

#[btf_map]
static INBOUND_LISTENERS: Listeners = Listeners {
    r#type: core::ptr::null(),
    key: core::ptr::null(),
    value: core::ptr::null(),
    max_entries: core::ptr::null(),
    map_flags: core::ptr::null(),
};

#[btf_map]
static SOCKET_STATES: SocketStates = SocketStates::new();

#[classifier]
pub fn adopt_listener(ctx: TcContext) -> i32 {
    match ctx.load::<AdoptRequest>(REQUEST_OFFSET) {
        Ok(request) => adopt(&ctx, &request),
        Err(_) => answer(&ctx, 0, OUTCOME_BAD_REQUEST, 0),
    }
    TC_ACT_OK
}

/// Writes the answer into the test packet (user space reads it back from `data_out`).
#[inline(always)]
fn answer(ctx: &TcContext, socket: u64, outcome: u32, detail: u32) {
    let answer = AdoptAnswer {
        socket,
        outcome,
        detail,
    };
    let _ = ctx.store(ANSWER_OFFSET, &answer, 0);
}

#[inline(always)]
fn adopt(ctx: &TcContext, request: &AdoptRequest) {
    let sk = lookup_listener(ctx, request);
    if sk.is_null() {
        answer(ctx, 0, OUTCOME_NOT_FOUND, 0);
        return;
    }
    let (outcome, detail) = match request.action {
        ACTION_INBOUND => register_inbound(sk, request),
        ACTION_OUTBOUND => give_netns(sk, request.netns_cookie),
        _ => (OUTCOME_BAD_REQUEST, 0),
    };
    // Written while the socket is held: its address is only an identity, compared in user space.
    answer(ctx, sk as usize as u64, outcome, detail);
    // SAFETY: `sk` came from the lookup above and is released once.
    unsafe { bpf_sk_release(sk.cast()) };
}

/// The listening TCP socket of the caller's netns that takes `request`'s address and port, held
/// (the caller releases it), or null. The source is the unspecified address, which no connection
/// has, so only a listener matches; its port picks the member of a `SO_REUSEPORT` group.
#[inline(always)]
fn lookup_listener(ctx: &TcContext, request: &AdoptRequest) -> *mut bpf_sock {
    // bpf_sock_tuple: saddr, daddr, sport, dport, network order; built with volatile stores (a
    // zeroed struct would become a memset call, which BPF does not have).
    let mut buf = core::mem::MaybeUninit::<[u32; 9]>::uninit();
    let p = buf.as_mut_ptr().cast::<u32>();
    let ports = u32::from(request.source_port.to_be()) | (u32::from(request.port.to_be()) << 16);
    let netns = BPF_F_CURRENT_NETNS as u64;
    // SAFETY: every store is inside the 36-byte buffer and the lookup reads only the bytes of the
    // tuple's family (12 or 36), all written.
    let sk = unsafe {
        if request.family == u32::from(AF_INET) {
            core::ptr::write_volatile(p, 0);
            core::ptr::write_volatile(p.add(1), request.addr[0]);
            core::ptr::write_volatile(p.add(2), ports);
            bpf_sk_lookup_tcp(ctx.as_ptr(), p.cast::<bpf_sock_tuple>(), 12, netns, 0)
        } else {
            for i in 0..4 {
                core::ptr::write_volatile(p.add(i), 0);
                core::ptr::write_volatile(p.add(4 + i), request.addr[i]);
            }
            core::ptr::write_volatile(p.add(8), ports);
            bpf_sk_lookup_tcp(ctx.as_ptr(), p.cast::<bpf_sock_tuple>(), 36, netns, 0)
        }
    };
    if sk.is_null() {
        return sk;
    }
    // SAFETY: a socket returned by the lookup, readable until released.
    if unsafe { (*sk).state } != TCP_LISTEN {
        // SAFETY: as above, released once.
        unsafe { bpf_sk_release(sk.cast()) };
        return core::ptr::null_mut();
    }
    sk
}

/// The socket's state, created zeroed if `create` and it has none.
#[inline(always)]
fn state_of(sk: *mut bpf_sock, create: bool) -> Option<&'static mut SockState> {
    let flags = if create {
        u64::from(BPF_SK_STORAGE_GET_F_CREATE)
    } else {
        0
    };
    // SAFETY: `sk` is a held full socket; the helper returns null or this socket's state, which
    // lives as long as the socket.
    unsafe {
        bpf_sk_storage_get(
            SOCKET_STATES.as_ptr(),
            sk.cast(),
            core::ptr::null_mut(),
            flags,
        )
        .cast::<SockState>()
        .as_mut()
    }
}

/// As the kernel registers a listener at `listen()`: its state says inbound listener of the pod,
/// and it takes the first free slot of its family, unless it holds one already.
#[inline(always)]
fn register_inbound(sk: *mut bpf_sock, request: &AdoptRequest) -> (u32, u32) {
    let Some(state) = state_of(sk, true) else {
        return (OUTCOME_NO_STATE, 0);
    };
    state.netns_cookie = request.netns_cookie;
    state.flags |= SOCK_INBOUND_LISTENER | SOCK_NETNS_KNOWN;
    let mut free = LISTENER_SLOTS;
    for slot in 0..LISTENER_SLOTS {
        let key = ListenerKey {
            netns_cookie: request.netns_cookie,
            family: request.family,
            slot,
        };
        // SAFETY: a sockhash lookup returns a held socket or null; it is released at once.
        let held = unsafe {
            bpf_map_lookup_elem(listener_map(), core::ptr::from_ref(&key).cast::<c_void>())
        }
        .cast::<bpf_sock>();
        if held.is_null() {
            if free == LISTENER_SLOTS {
                free = slot;
            }
            continue;
        }
        let same = held == sk;
        // SAFETY: as above.
        unsafe { bpf_sk_release(held.cast()) };
        if same {
            return (OUTCOME_ALREADY, slot);
        }
    }
    if free == LISTENER_SLOTS {
        return (OUTCOME_SLOTS_FULL, 0);
    }
    let key = ListenerKey {
        netns_cookie: request.netns_cookie,
        family: request.family,
        slot: free,
    };
    // SAFETY: the key lives on the stack for the call; `sk` is a held full socket.
    let rc = unsafe {
        bpf_map_update_elem(
            listener_map(),
            core::ptr::from_ref(&key).cast::<c_void>(),
            sk.cast::<c_void>(),
            u64::from(BPF_NOEXIST),
        )
    };
    if rc == 0 {
        (OUTCOME_REGISTERED, free)
    } else {
        (OUTCOME_MAP_REFUSED, rc.unsigned_abs() as u32)
    }
}

/// The listener map, as the helpers take it.
#[inline(always)]
fn listener_map() -> *mut c_void {
    core::ptr::from_ref(&INBOUND_LISTENERS).cast_mut().cast()
}

/// An outbound listener without state gets the pod's netns, which its accepted sockets inherit.
/// One with state (created after the attach, or given it before) keeps it.
#[inline(always)]
fn give_netns(sk: *mut bpf_sock, netns_cookie: u64) -> (u32, u32) {
    if state_of(sk, false).is_some() {
        return (OUTCOME_ALREADY, 0);
    }
    let Some(state) = state_of(sk, true) else {
        return (OUTCOME_NO_STATE, 0);
    };
    state.netns_cookie = netns_cookie;
    state.flags = SOCK_NETNS_KNOWN;
    (OUTCOME_REGISTERED, 0)
}

#[cfg(not(test))]
#[panic_handler]
fn panic(_info: &core::panic::PanicInfo) -> ! {
    loop {}
}
