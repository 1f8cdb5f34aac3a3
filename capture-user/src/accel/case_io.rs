//! The system calls and byte patterns the acceleration's cases are written with: each returns
//! what the kernel answered, errno included, so that a case can write it down.

use std::{
    io::{self, Read as _},
    net::TcpStream,
    os::fd::RawFd,
    time::Duration,
};

/// FNV-1a: enough to tell two byte streams apart in an observation.
pub fn digest(bytes: &[u8]) -> String {
    let h = bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    });
    format!("{} bytes, fnv {h:016x}", bytes.len())
}

/// Bytes that differ from position to position, so that a reordering shows: a 64 KiB block of
/// mixed bytes, repeated, with each block's first eight bytes XORed with its index. Made of
/// copies of one block because the test builds are unoptimized: byte by byte, the cases' 64 MiB
/// per run cost most of a check's time under the kernel matrix's emulation.
pub fn pattern(len: usize, seed: u8) -> Vec<u8> {
    const BLOCK: usize = 1 << 16;
    let block: Vec<u8> = (0..BLOCK.min(len))
        .map(|i| (i as u32).wrapping_mul(2_654_435_761).to_le_bytes()[3] ^ seed)
        .collect();
    let mut out = Vec::with_capacity(len);
    for (index, start) in (0..len).step_by(BLOCK).enumerate() {
        out.extend_from_slice(&block[..BLOCK.min(len - start)]);
        for (byte, stamp) in out[start..].iter_mut().zip(index.to_le_bytes()) {
            *byte ^= stamp;
        }
    }
    out
}

pub fn read_exactly(s: &mut TcpStream, len: usize) -> io::Result<Vec<u8>> {
    let mut buf = vec![0; len];
    s.read_exact(&mut buf)?;
    Ok(buf)
}

/// The outcome of a call, as an observation line: the value, or the errno's name.
pub fn outcome<T: std::fmt::Debug>(what: &str, r: io::Result<T>) -> String {
    match r {
        Ok(v) => format!("{what}: ok {v:?}"),
        Err(e) => format!("{what}: {:?}", e.kind()),
    }
}

pub fn errno_result(rc: isize) -> io::Result<usize> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

pub fn recv(fd: RawFd, buf: &mut [u8], flags: i32) -> io::Result<usize> {
    // SAFETY: `buf` is valid for its length.
    errno_result(unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) })
}

pub fn send(fd: RawFd, buf: &[u8], flags: i32) -> io::Result<usize> {
    // SAFETY: `buf` is valid for its length.
    errno_result(unsafe { libc::send(fd, buf.as_ptr().cast(), buf.len(), flags) })
}

/// An unnamed file in /tmp (gone when closed).
pub fn tempfile() -> io::Result<std::fs::File> {
    std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .custom_flags_tmpfile()
        .open(std::env::temp_dir())
}

pub fn pipe() -> io::Result<(std::fs::File, std::fs::File)> {
    use std::os::fd::FromRawFd as _;
    let mut fds = [0; 2];
    // SAFETY: `fds` has room for the two descriptors.
    if unsafe { libc::pipe(fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned these fds; nothing else owns them.
    Ok(unsafe {
        (
            std::fs::File::from_raw_fd(fds[0]),
            std::fs::File::from_raw_fd(fds[1]),
        )
    })
}

pub fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: plain fds; null offsets (pipes and sockets have none).
    errno_result(unsafe {
        libc::splice(from, std::ptr::null_mut(), to, std::ptr::null_mut(), len, 0)
    })
}

pub fn poll_one(fd: RawFd, events: i16, timeout_ms: i32) -> io::Result<i16> {
    let mut p = libc::pollfd {
        fd,
        events,
        revents: 0,
    };
    // SAFETY: one valid pollfd.
    let n = unsafe { libc::poll(&raw mut p, 1, timeout_ms) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(p.revents)
}

/// Waits until `fd` is readable (5 s at most), then a moment more for the rest of a small
/// write. Readiness only: FIONREAD is a case of its own.
pub fn wait_readable(fd: RawFd) -> io::Result<()> {
    if poll_one(fd, libc::POLLIN, 5000)? & libc::POLLIN == 0 {
        return Err(io::Error::from(io::ErrorKind::TimedOut));
    }
    std::thread::sleep(Duration::from_millis(20));
    Ok(())
}

pub fn inq(fd: RawFd) -> io::Result<usize> {
    let mut n: libc::c_int = 0;
    // SAFETY: FIONREAD writes one int.
    if unsafe { libc::ioctl(fd, libc::FIONREAD, &mut n) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(n as usize)
}

pub fn set_int(fd: RawFd, level: i32, name: i32, value: i32) -> io::Result<()> {
    // SAFETY: one int, its size given.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            level,
            name,
            (&raw const value).cast(),
            size_of::<i32>() as u32,
        )
    };
    if rc != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

pub trait TmpfileFlag {
    fn custom_flags_tmpfile(&mut self) -> &mut Self;
}

impl TmpfileFlag for std::fs::OpenOptions {
    fn custom_flags_tmpfile(&mut self) -> &mut Self {
        use std::os::unix::fs::OpenOptionsExt as _;
        self.custom_flags(libc::O_TMPFILE)
    }
}

#[cfg(test)]
mod tests {
    use super::pattern;

    #[test]
    fn a_pattern_shows_blocks_out_of_order() {
        let block = 1 << 16;
        let bytes = pattern(3 * block + 100, 7);
        assert_eq!(bytes.len(), 3 * block + 100);
        let blocks: Vec<&[u8]> = bytes.chunks(block).collect();
        assert_ne!(blocks[0], blocks[1], "whole blocks swapped would not show");
        assert_ne!(blocks[1], blocks[2]);
        assert_ne!(&bytes[..8], &bytes[8..16], "words swapped would not show");
        assert_eq!(bytes, pattern(3 * block + 100, 7));
        assert_ne!(bytes, pattern(3 * block + 100, 8), "the seed matters");
    }
}
