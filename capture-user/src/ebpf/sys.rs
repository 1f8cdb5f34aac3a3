//! The few bpf(2) commands capture issues itself: aya 0.14 cannot turn every cgroup link into a
//! pinnable fd link (getsockopt links among them), so links are created and pinned here, the
//! same way for every hook.

use std::{
    ffi::CString,
    io,
    os::{
        fd::{AsRawFd as _, BorrowedFd, FromRawFd as _, OwnedFd},
        unix::ffi::OsStrExt as _,
    },
    path::Path,
};

const BPF_OBJ_PIN: libc::c_long = 6;
const BPF_OBJ_GET: libc::c_long = 7;
const BPF_LINK_CREATE: libc::c_long = 28;

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

/// `BPF_LINK_CREATE`: attach `prog` to `target` (a cgroup or netns fd) as a bpf_link.
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
