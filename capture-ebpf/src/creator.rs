//! A TCP socket's owner as iptables' `-m owner` judges it: the fsuid and fsgid of the credentials
//! its file was opened with (`sk->sk_socket->file->f_cred`), read from the socket when the
//! program needs them. Nothing is recorded when the socket is created, so a connection costs no
//! socket-local storage for its owner, and a socket created before capture was attached is
//! judged by its creator too.
//!
//! The kernel's struct layouts differ between versions and configurations, and these programs
//! carry no relocations for them: the loader reads the offsets from the kernel's BTF and writes
//! them, with the switch, into `.rodata`, where the verifier sees them as constants. With the
//! switch off (a kernel whose verifier refuses the walk, or without `sock_ops`' netns cookie), the
//! walk is never visited and `sock_create` records the creator instead.

use aya_ebpf::{cty::c_void, helpers::generated::bpf_skc_to_tcp_sock};

use crate::rodata::constant;

#[no_mangle]
static OWNER_FROM_FILE: u8 = 0;
#[no_mangle]
static OWNER_OFFSET_SOCK_SK_SOCKET: u32 = 0;
#[no_mangle]
static OWNER_OFFSET_SOCKET_FILE: u32 = 0;
#[no_mangle]
static OWNER_OFFSET_FILE_F_CRED: u32 = 0;
#[no_mangle]
static OWNER_OFFSET_CRED_FSUID: u32 = 0;
#[no_mangle]
static OWNER_OFFSET_CRED_FSGID: u32 = 0;

/// Are TCP sockets judged by their file's credentials (and not recorded at creation)?
#[inline(always)]
pub fn from_file() -> bool {
    constant(&OWNER_FROM_FILE) != 0
}

/// The value at `offset` bytes into the kernel object at `base`.
///
/// # Safety
/// `base` is a BTF-typed kernel pointer the verifier tracks, and `offset` one of the offsets the
/// loader found for it; the verifier checks the read against the type and turns it into a
/// fault-tolerant load.
#[inline(always)]
unsafe fn field<T: Copy>(base: *const u8, offset: u32) -> T {
    // SAFETY: see the function's contract.
    unsafe { core::ptr::read_volatile(base.add(offset as usize).cast::<T>()) }
}

/// The TCP socket `sk`'s owner (fsuid, fsgid); `None` for a socket without a file (a kernel
/// socket), which the owner match never matches.
#[inline(always)]
pub fn tcp_owner(sk: *mut c_void) -> Option<(u32, u32)> {
    // SAFETY: `sk` is the program's socket; the helper returns null or the socket as a
    // `tcp_sock`, which begins with its `sock` (the loader checked that in the BTF). Each step is
    // read through `field` and checked for null before the next.
    unsafe {
        let tcp = bpf_skc_to_tcp_sock(sk).cast::<u8>().cast_const();
        if tcp.is_null() {
            return None;
        }
        let socket: *const u8 = field(tcp, constant(&OWNER_OFFSET_SOCK_SK_SOCKET));
        if socket.is_null() {
            return None;
        }
        let file: *const u8 = field(socket, constant(&OWNER_OFFSET_SOCKET_FILE));
        if file.is_null() {
            return None;
        }
        let cred: *const u8 = field(file, constant(&OWNER_OFFSET_FILE_F_CRED));
        if cred.is_null() {
            return None;
        }
        Some((
            field(cred, constant(&OWNER_OFFSET_CRED_FSUID)),
            field(cred, constant(&OWNER_OFFSET_CRED_FSGID)),
        ))
    }
}
