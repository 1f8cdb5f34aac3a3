//! Pods with a user namespace of their own (Kubernetes `hostUsers: false`).
//!
//! Such a pod's netns belongs to its user namespace, and its processes' ids inside are other ids
//! on the host: the proxy's 1337 is, say, 101337 to the kernel. The two backends meet this
//! differently, each as the kernel requires:
//! - iptables' owner match takes ids as the pod sees them, but the kernel accepts such a rule only
//!   from a writer in the netns's own user namespace, so the rule tools run inside it;
//! - the ebpf programs see host ids (`bpf_get_current_uid_gid` answers in the initial user
//!   namespace), so the configured ids are translated through the pod's id maps at attach and
//!   kept with the pod's record.

use std::{
    fs::File,
    io,
    os::{
        fd::{AsRawFd as _, FromRawFd as _, OwnedFd, RawFd},
        unix::{fs::MetadataExt as _, process::CommandExt as _},
    },
    process::Command,
};

use serde::{Deserialize, Serialize};

/// A pod's configured ids as the host (and so the ebpf programs) sees them, for a pod with a
/// user namespace of its own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostIds {
    pub proxy_uids: Vec<u32>,
    pub proxy_gids: Vec<u32>,
    /// The owner-group list's gids, in its order.
    #[serde(default)]
    pub owner_groups: Vec<u32>,
}

/// `NS_GET_USERNS` and `NS_GET_PARENT` (linux/nsfs.h): `_IO(0xb7, 1)` and `_IO(0xb7, 2)`.
const NS_GET_USERNS: libc::c_ulong = 0xb701;
const NS_GET_PARENT: libc::c_ulong = 0xb702;

#[derive(Debug, thiserror::Error)]
pub enum UsernsError {
    #[error("finding the user namespace of the pod's netns: {0}")]
    Owner(io::Error),
    #[error("the pod's user namespace is nested inside another one; capture supports one level (the pod's own under the node's)")]
    Nested,
    #[error("reading the pod's user namespace {file}: {detail}")]
    Map { file: &'static str, detail: String },
    #[error("the pod's user namespace maps no host id to the proxy's {what} {id} (its {file}: {map}); the proxy's own traffic could not be told apart from the app's: map the proxy's ids in the pod's user namespace")]
    Unmapped {
        what: &'static str,
        id: u32,
        file: &'static str,
        map: String,
    },
}

/// One line of an id map: `count` ids from `inside` are `outside` onwards in the parent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Extent {
    inside: u32,
    outside: u32,
    count: u32,
}

fn parse_map(text: &str) -> Option<Vec<Extent>> {
    text.lines()
        .filter(|l| !l.trim().is_empty())
        .map(|line| {
            let mut f = line.split_whitespace().map(str::parse::<u32>);
            Some(Extent {
                inside: f.next()?.ok()?,
                outside: f.next()?.ok()?,
                count: f.next()?.ok()?,
            })
        })
        .collect()
}

fn to_host(map: &[Extent], id: u32) -> Option<u32> {
    map.iter().find_map(|e| {
        let offset = id.checked_sub(e.inside)?;
        (offset < e.count)
            .then(|| e.outside.checked_add(offset))
            .flatten()
    })
}

fn ns_ioctl(fd: RawFd, request: libc::c_ulong) -> io::Result<OwnedFd> {
    // SAFETY: an nsfs ioctl on a valid descriptor; it returns a new descriptor or -1.
    let raw = unsafe { libc::ioctl(fd, request) };
    if raw < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: the kernel just returned this descriptor to us.
    Ok(unsafe { OwnedFd::from_raw_fd(raw) })
}

fn same_ns(fd: &OwnedFd, ours: &std::fs::Metadata) -> io::Result<bool> {
    let theirs = File::from(fd.try_clone()?).metadata()?;
    Ok(theirs.dev() == ours.dev() && theirs.ino() == ours.ino())
}

/// The user namespace that owns `netns`, if it is not this process's own.
pub fn owner_of(netns: &File) -> Result<Option<OwnedFd>, UsernsError> {
    let owner = ns_ioctl(netns.as_raw_fd(), NS_GET_USERNS).map_err(UsernsError::Owner)?;
    let ours = std::fs::metadata("/proc/self/ns/user").map_err(UsernsError::Owner)?;
    if same_ns(&owner, &ours).map_err(UsernsError::Owner)? {
        return Ok(None);
    }
    let parent = ns_ioctl(owner.as_raw_fd(), NS_GET_PARENT).map_err(UsernsError::Owner)?;
    if !same_ns(&parent, &ours).map_err(UsernsError::Owner)? {
        return Err(UsernsError::Nested);
    }
    Ok(Some(owner))
}

/// Makes `cmd` start inside `userns` as its root, for the tools whose writes the kernel accepts
/// only from the netns's own user namespace. Root there, as nsenter does it: exec drops every
/// capability of a uid the namespace does not map (the node's root is not mapped in a pod's).
pub fn run_inside(cmd: &mut Command, userns: &OwnedFd) {
    let raw = userns.as_raw_fd();
    // SAFETY: the hook runs in the forked child before exec and makes only async-signal-safe
    // credential syscalls; the descriptor stays open until the child execs.
    unsafe {
        cmd.pre_exec(move || {
            if libc::setns(raw, libc::CLONE_NEWUSER) != 0
                || libc::setgroups(0, std::ptr::null()) != 0
                || libc::setresgid(0, 0, 0) != 0
                || libc::setresuid(0, 0, 0) != 0
            {
                return Err(io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// One of the namespace's id maps, relative to the node: read by a process inside it, for which
/// the kernel shows the parent's (here the node's) ids.
fn read_map(userns: &OwnedFd, file: &'static str) -> Result<Vec<Extent>, UsernsError> {
    let failed = |detail: String| UsernsError::Map { file, detail };
    let mut cmd = Command::new("cat");
    cmd.arg(format!("/proc/self/{file}"));
    run_inside(&mut cmd, userns);
    let out = cmd
        .output()
        .map_err(|e| failed(format!("running cat: {e}")))?;
    if !out.status.success() {
        return Err(failed(
            String::from_utf8_lossy(&out.stderr).trim().to_string(),
        ));
    }
    let text = String::from_utf8_lossy(&out.stdout);
    parse_map(&text).ok_or_else(|| failed(format!("unreadable map {text:?}")))
}

fn translate(
    map: &[Extent],
    ids: &[u32],
    what: &'static str,
    file: &'static str,
) -> Result<Vec<u32>, UsernsError> {
    ids.iter()
        .map(|&id| {
            to_host(map, id).ok_or_else(|| UsernsError::Unmapped {
                what,
                id,
                file,
                map: map
                    .iter()
                    .map(|e| format!("{} {} {}", e.inside, e.outside, e.count))
                    .collect::<Vec<_>>()
                    .join("; "),
            })
        })
        .collect()
}

/// A pod's ids (the pod's view) on the host, for a pod whose netns has a user namespace of its
/// own; `None` for every other pod (its ids are the host's already).
pub fn host_ids(netns: &File, pod_ids: &HostIds) -> Result<Option<HostIds>, UsernsError> {
    let Some(userns) = owner_of(netns)? else {
        return Ok(None);
    };
    let uid_map = read_map(&userns, "uid_map")?;
    let gid_map = read_map(&userns, "gid_map")?;
    Ok(Some(HostIds {
        proxy_uids: translate(&uid_map, &pod_ids.proxy_uids, "uid", "uid_map")?,
        proxy_gids: translate(&gid_map, &pod_ids.proxy_gids, "gid", "gid_map")?,
        owner_groups: translate(&gid_map, &pod_ids.owner_groups, "owner group", "gid_map")?,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_translate_through_every_extent_and_no_further() {
        let map = parse_map("         0     100000      65536\n 70000 500 10\n").expect("map");
        assert_eq!(to_host(&map, 0), Some(100_000));
        assert_eq!(to_host(&map, 1337), Some(101_337));
        assert_eq!(to_host(&map, 65535), Some(165_535));
        assert_eq!(to_host(&map, 65536), None);
        assert_eq!(to_host(&map, 70_009), Some(509));
        assert_eq!(to_host(&map, 70_010), None);
        let err = translate(&map, &[1337, 66_000], "uid", "uid_map").expect_err("unmapped");
        assert!(err.to_string().contains("uid 66000"), "{err}");
    }

    #[test]
    fn a_map_that_is_not_one_is_refused() {
        assert!(parse_map("0 100000\n").is_none());
        assert!(parse_map("a b c\n").is_none());
        assert_eq!(parse_map("").map(|m| m.len()), Some(0));
    }

    #[test]
    fn this_process_netns_has_no_user_namespace_of_its_own() {
        let netns = File::open("/proc/self/ns/net").expect("own netns");
        assert!(owner_of(&netns).expect("owner").is_none());
    }
}
