//! Finding a pod's cgroup from its UID, for both of kubelet's cgroup drivers:
//! cgroupfs (`kubepods/burstable/pod<uid>`) and systemd
//! (`kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_with_underscores>.slice`),
//! in the cgroup2 hierarchy first and then in the v1 ones (a node booted without cgroup v2 has its
//! pods there; the rule backends capture them, the ebpf backend refuses them and says why).

use std::path::{Path, PathBuf};

/// Directory names kubelet gives the pod's cgroup.
fn matches(name: &str, uid: &str) -> bool {
    let systemd_uid = uid.replace('-', "_");
    name == format!("pod{uid}")
        || (name.starts_with("kubepods") && name.ends_with(&format!("pod{systemd_uid}.slice")))
}

/// Where kubelet puts the pod's cgroup below `root` with its default `--cgroup-root`: each QoS
/// class (guaranteed pods directly under kubepods), under either driver.
fn kubelet_paths(root: &Path, uid: &str) -> [PathBuf; 6] {
    let systemd_uid = uid.replace('-', "_");
    let slice = root.join("kubepods.slice");
    [
        root.join("kubepods/burstable").join(format!("pod{uid}")),
        root.join("kubepods/besteffort").join(format!("pod{uid}")),
        root.join("kubepods").join(format!("pod{uid}")),
        slice.join(format!(
            "kubepods-burstable.slice/kubepods-burstable-pod{systemd_uid}.slice"
        )),
        slice.join(format!(
            "kubepods-besteffort.slice/kubepods-besteffort-pod{systemd_uid}.slice"
        )),
        slice.join(format!("kubepods-pod{systemd_uid}.slice")),
    ]
}

/// Finds the pod's cgroup below `root`: at kubelet's own paths first (a look each, where a
/// search would read the directory of every pod of the node before it), else searching a few
/// levels deep, as a kubelet with another `--cgroup-root` nests it.
pub fn find_pod_cgroup(root: &Path, uid: &str) -> Result<PathBuf, String> {
    if uid.is_empty() || uid.contains('/') {
        return Err(format!("pod UID {uid:?} is not a UID"));
    }
    if let Some(found) = kubelet_paths(root, uid).into_iter().find(|p| p.is_dir()) {
        return Ok(found);
    }
    let mut level = vec![root.to_path_buf()];
    for _ in 0..4 {
        let mut next = Vec::new();
        for dir in level {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                continue;
            };
            for e in entries.flatten() {
                if !e.file_type().is_ok_and(|t| t.is_dir()) {
                    continue;
                }
                if matches(&e.file_name().to_string_lossy(), uid) {
                    return Ok(e.path());
                }
                next.push(e.path());
            }
        }
        level = next;
    }
    Err(format!(
        "pod UID {uid} has no cgroup under {} (looked for pod{uid} and *-pod{}.slice); check the plugin's cgroup_root and kubelet's cgroup driver",
        root.display(),
        uid.replace('-', "_")
    ))
}

/// The pod's cgroup on this node: under the cgroup2 mount, else under a v1 hierarchy.
pub fn find_on_node(uid: &str) -> Result<PathBuf, String> {
    let roots: Vec<PathBuf> = crate::cgroup::cgroup2_mount()
        .into_iter()
        .chain(crate::cgroup::cgroup1_mounts())
        .collect();
    if roots.is_empty() {
        return Err("no cgroup hierarchy is mounted (see /proc/self/mounts)".into());
    }
    let mut why = Vec::new();
    for root in &roots {
        match find_pod_cgroup(root, uid) {
            Ok(found) => return Ok(found),
            Err(e) => why.push(e),
        }
    }
    Err(why.join("; "))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_layouts() {
        let root =
            std::env::temp_dir().join(format!("capture-cgroup-layout-{}", std::process::id()));
        let cgroupfs = root.join("kubepods/burstable/pod1234-ab");
        let systemd = root
            .join("kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod99_cd.slice");
        // Guaranteed pods sit directly under kubepods; a kubelet with another --cgroup-root
        // nests the tree deeper.
        let guaranteed = root.join("kubepods.slice/kubepods-pod77_ef.slice");
        let nested = root.join("kubelet/kubepods/burstable/pod55-aa");
        std::fs::create_dir_all(&cgroupfs).unwrap();
        std::fs::create_dir_all(&systemd).unwrap();
        std::fs::create_dir_all(&guaranteed).unwrap();
        std::fs::create_dir_all(&nested).unwrap();
        assert_eq!(find_pod_cgroup(&root, "1234-ab").unwrap(), cgroupfs);
        assert_eq!(find_pod_cgroup(&root, "99-cd").unwrap(), systemd);
        assert_eq!(find_pod_cgroup(&root, "77-ef").unwrap(), guaranteed);
        assert_eq!(find_pod_cgroup(&root, "55-aa").unwrap(), nested);
        let e = find_pod_cgroup(&root, "nope").unwrap_err();
        assert!(e.contains("nope") && e.contains("cgroup_root"), "{e}");
        assert!(find_pod_cgroup(&root, "../x").is_err());
        std::fs::remove_dir_all(&root).unwrap();
    }
}
