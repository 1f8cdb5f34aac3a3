//! The few bpf(2) commands capture issues itself: aya 0.14 cannot turn every cgroup link into a
//! pinnable fd link (getsockopt links among them), so links are created and pinned here, the
//! same way for every hook; and the attachment query, which bpftool cannot do on every kernel
//! (its `cgroup show` fails where the kernel predates one of the attach types it asks about).

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsFd as _, AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_MAP_GET_NEXT_KEY: libc::c_long = 4;
const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_PROG_ATTACH: libc::c_long = 8;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_PROG_GET_FD_BY_ID: libc::c_long = 13;
const BPF_MAP_GET_FD_BY_ID: libc::c_long = 14;
const BPF_OBJ_GET_INFO_BY_FD: libc::c_long = 15;
const BPF_PROG_QUERY: libc::c_long = 16;
const BPF_LINK_CREATE: libc::c_long = 28;
const BPF_LINK_UPDATE: libc::c_long = 29;
const BPF_LINK_DETACH: libc::c_long = 34;

/// `union bpf_attr` is larger; the kernel zero-checks the tail, so a zeroed 128-byte buffer with
/// the command's leading fields filled in is a valid attr for each command used here.
#[repr(C, align(8))]
struct Attr([u8; 128]);

impl Attr {
    fn new() -> Self {
        Self([0; 128])
    }
    fn put_u32(&mut self, offset: usize, v: u32) {
        self.0[offset..offset + 4].copy_from_slice(&v.to_ne_bytes());
    }
    fn put_u64(&mut self, offset: usize, v: u64) {
        self.0[offset..offset + 8].copy_from_slice(&v.to_ne_bytes());
    }
}

fn bpf(cmd: libc::c_long, attr: &mut Attr) -> io::Result<libc::c_long> {
    // SAFETY: `attr` is a properly aligned, zero-padded bpf_attr for `cmd`.
    let rc = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.0.as_mut_ptr(), size_of::<Attr>()) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn c_path(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))
}

/// `BPF_LINK_CREATE`: attach `prog` to `target` (a cgroup or netns fd) as a `bpf_link`.
pub fn link_create(
    prog: BorrowedFd<'_>,
    target: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.put_u32(0, prog.as_raw_fd() as u32);
    attr.put_u32(4, target.as_raw_fd() as u32);
    attr.put_u32(8, attach_type);
    let fd = bpf(BPF_LINK_CREATE, &mut attr)?;
    // SAFETY: the kernel returned a new fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_PROG_ATTACH` of an `sk_msg` program to a sockmap or sockhash. The map holds the program
/// from then on (it has no link), so the attachment lasts as long as the map's pin; attaching
/// another program replaces it for sockets that join later.
pub fn prog_attach_to_map(
    prog: BorrowedFd<'_>,
    map: BorrowedFd<'_>,
    attach_type: u32,
) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.put_u32(0, map.as_raw_fd() as u32);
    attr.put_u32(4, prog.as_raw_fd() as u32);
    attr.put_u32(8, attach_type);
    bpf(BPF_PROG_ATTACH, &mut attr).map(drop)
}

/// `BPF_LINK_DETACH` (Linux 5.9+): take the link off its cgroup or netns now, whoever still holds
/// a reference to it.
pub fn link_detach(link: BorrowedFd<'_>) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.put_u32(0, link.as_raw_fd() as u32);
    bpf(BPF_LINK_DETACH, &mut attr).map(drop)
}

/// `BPF_OBJ_PIN`: pin a program, map or link at `path` (on bpffs).
pub fn obj_pin(fd: BorrowedFd<'_>, path: &Path) -> io::Result<()> {
    let path = c_path(path)?;
    let mut attr = Attr::new();
    attr.put_u64(0, path.as_ptr() as u64);
    attr.put_u32(8, fd.as_raw_fd() as u32);
    bpf(BPF_OBJ_PIN, &mut attr).map(drop)
}

/// `BPF_OBJ_GET`: open a pinned object.
pub fn obj_get(path: &Path) -> io::Result<OwnedFd> {
    let path = c_path(path)?;
    let mut attr = Attr::new();
    attr.put_u64(0, path.as_ptr() as u64);
    let fd = bpf(BPF_OBJ_GET, &mut attr)?;
    // SAFETY: a new fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// `BPF_PROG_QUERY`: the ids of the programs attached to `target` (a cgroup) at `attach_type`.
/// An attach type this kernel does not know has nothing attached.
pub fn prog_query(target: BorrowedFd<'_>, attach_type: u32) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 64];
    let mut attr = Attr::new();
    attr.put_u32(0, target.as_raw_fd() as u32);
    attr.put_u32(4, attach_type);
    attr.put_u64(16, ids.as_mut_ptr() as u64);
    attr.put_u32(24, ids.len() as u32);
    match bpf(BPF_PROG_QUERY, &mut attr) {
        Ok(_) => {}
        Err(e) if e.raw_os_error() == Some(libc::EINVAL) => return Ok(Vec::new()),
        Err(e) => return Err(e),
    }
    let count = u32::from_ne_bytes(attr.0[24..28].try_into().expect("4 bytes")) as usize;
    Ok(ids[..count.min(ids.len())].to_vec())
}

/// The name of a loaded program (as the kernel keeps it: at most 15 bytes).
pub fn prog_name(id: u32) -> io::Result<String> {
    let mut attr = Attr::new();
    attr.put_u32(0, id);
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: a new fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    // `struct bpf_prog_info` up to its `name` field (bytes 64..80).
    let mut info = [0u8; 80];
    let mut attr = Attr::new();
    attr.put_u32(0, fd.as_raw_fd() as u32);
    attr.put_u32(4, info.len() as u32);
    attr.put_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr)?;
    let name = &info[64..80];
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    Ok(String::from_utf8_lossy(&name[..len]).into_owned())
}

/// `BPF_LINK_UPDATE`: the link runs `new_prog` from now on, in one step (no moment without a
/// program); with `old_prog`, only if the link still runs that one.
pub fn link_update(
    link: BorrowedFd<'_>,
    new_prog: BorrowedFd<'_>,
    old_prog: Option<BorrowedFd<'_>>,
) -> io::Result<()> {
    const BPF_F_REPLACE: u32 = 1 << 2;
    let mut attr = Attr::new();
    attr.put_u32(0, link.as_raw_fd() as u32);
    attr.put_u32(4, new_prog.as_raw_fd() as u32);
    if let Some(old) = old_prog {
        attr.put_u32(8, BPF_F_REPLACE);
        attr.put_u32(12, old.as_raw_fd() as u32);
    }
    bpf(BPF_LINK_UPDATE, &mut attr).map(drop)
}

/// `BPF_OBJ_GET_INFO_BY_FD` into `info` (the kernel fills what it knows of the struct).
fn obj_info(fd: BorrowedFd<'_>, info: &mut [u8]) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.put_u32(0, fd.as_raw_fd() as u32);
    attr.put_u32(4, info.len() as u32);
    attr.put_u64(8, info.as_mut_ptr() as u64);
    bpf(BPF_OBJ_GET_INFO_BY_FD, &mut attr).map(drop)
}

fn u32_at(bytes: &[u8], offset: usize) -> u32 {
    u32::from_ne_bytes(bytes[offset..offset + 4].try_into().expect("4 bytes"))
}

/// The kernel's id of a program (`struct bpf_prog_info`: type, id).
pub fn prog_id(prog: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u8; 8];
    obj_info(prog, &mut info)?;
    Ok(u32_at(&info, 4))
}

/// The id of the program a link runs (`struct bpf_link_info`: type, id, `prog_id`).
pub fn link_prog_id(link: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u8; 12];
    obj_info(link, &mut info)?;
    Ok(u32_at(&info, 8))
}

/// What the kernel says a map is (`struct bpf_map_info` up to `map_flags`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MapDefinition {
    pub map_type: u32,
    pub key_size: u32,
    pub value_size: u32,
    pub max_entries: u32,
    pub map_flags: u32,
}

pub fn map_definition(map: BorrowedFd<'_>) -> io::Result<MapDefinition> {
    let mut info = [0u8; 24];
    obj_info(map, &mut info)?;
    Ok(MapDefinition {
        map_type: u32_at(&info, 0),
        key_size: u32_at(&info, 8),
        value_size: u32_at(&info, 12),
        max_entries: u32_at(&info, 16),
        map_flags: u32_at(&info, 20),
    })
}

/// `BPF_MAP_GET_NEXT_KEY`: the key after `key` (the first with `None`); `Ok(false)` at the end.
pub fn map_next_key(map: BorrowedFd<'_>, key: Option<&[u8]>, next: &mut [u8]) -> io::Result<bool> {
    let mut attr = Attr::new();
    attr.put_u32(0, map.as_raw_fd() as u32);
    attr.put_u64(8, key.map_or(0, |k| k.as_ptr() as u64));
    attr.put_u64(16, next.as_mut_ptr() as u64);
    match bpf(BPF_MAP_GET_NEXT_KEY, &mut attr) {
        Ok(_) => Ok(true),
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => Ok(false),
        Err(e) => Err(e),
    }
}

/// `BPF_MAP_LOOKUP_ELEM` of raw bytes (per-CPU maps fill one slot per possible CPU).
pub fn map_lookup(map: BorrowedFd<'_>, key: &[u8], value: &mut [u8]) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.put_u32(0, map.as_raw_fd() as u32);
    attr.put_u64(8, key.as_ptr() as u64);
    attr.put_u64(16, value.as_mut_ptr() as u64);
    bpf(BPF_MAP_LOOKUP_ELEM, &mut attr).map(drop)
}

/// `BPF_MAP_UPDATE_ELEM` of raw bytes.
pub fn map_update(map: BorrowedFd<'_>, key: &[u8], value: &[u8], flags: u64) -> io::Result<()> {
    let mut attr = Attr::new();
    attr.put_u32(0, map.as_raw_fd() as u32);
    attr.put_u64(8, key.as_ptr() as u64);
    attr.put_u64(16, value.as_ptr() as u64);
    attr.put_u64(24, flags);
    bpf(BPF_MAP_UPDATE_ELEM, &mut attr).map(drop)
}

/// An fd for the program with kernel id `id`.
pub fn prog_by_id(id: u32) -> io::Result<OwnedFd> {
    let mut attr = Attr::new();
    attr.put_u32(0, id);
    let fd = bpf(BPF_PROG_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: a new fd owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

/// The ids of the maps a program uses (`struct bpf_prog_info`: `nr_map_ids` at 52, `map_ids`
/// at 56).
pub fn prog_map_ids(prog: BorrowedFd<'_>) -> io::Result<Vec<u32>> {
    let mut ids = [0u32; 32];
    let mut info = [0u8; 64];
    info[52..56].copy_from_slice(&(ids.len() as u32).to_ne_bytes());
    info[56..64].copy_from_slice(&(ids.as_mut_ptr() as u64).to_ne_bytes());
    obj_info(prog, &mut info)?;
    let count = (u32_at(&info, 52) as usize).min(ids.len());
    Ok(ids[..count].to_vec())
}

/// An fd for the map with kernel id `id`, and its name (as the kernel keeps it: 15 bytes).
pub fn map_by_id(id: u32) -> io::Result<(OwnedFd, String)> {
    let mut attr = Attr::new();
    attr.put_u32(0, id);
    let fd = bpf(BPF_MAP_GET_FD_BY_ID, &mut attr)?;
    // SAFETY: a new fd owned by nobody else.
    let fd = unsafe { OwnedFd::from_raw_fd(fd as i32) };
    let mut info = [0u8; 40];
    obj_info(fd.as_fd(), &mut info)?;
    let name = &info[24..40];
    let len = name.iter().position(|&b| b == 0).unwrap_or(name.len());
    let name = String::from_utf8_lossy(&name[..len]).into_owned();
    Ok((fd, name))
}

/// The kernel's id of a program, map or link (each info struct has it second).
pub fn obj_id(fd: BorrowedFd<'_>) -> io::Result<u32> {
    let mut info = [0u8; 8];
    obj_info(fd, &mut info)?;
    Ok(u32_at(&info, 4))
}
