//! A node's pinned maps and programs as the tests read them (through bpftool, as an operator
//! would): where they are, how many entries a map holds, and entries put in or taken out behind
//! capture's back.

use std::{path::PathBuf, process::Command};

/// The directory of the node's program and map pins: the one build's under `builds/` (a node
/// between takeovers has exactly one).
#[must_use]
pub fn node_pin_dir(bpffs: &std::path::Path) -> PathBuf {
    let builds: Vec<_> = bpffs
        .join("builds")
        .read_dir()
        .expect("the node's builds pin directory")
        .flatten()
        .map(|e| e.path())
        .collect();
    match &builds[..] {
        [one] => one.clone(),
        other => panic!(
            "expected the pins of one build under {}, found {other:?}",
            bpffs.display()
        ),
    }
}

/// The node's maps that hold entries of pods: none may keep any once every pod is gone.
pub const POD_MAPS: [&str; 9] = [
    "POD_CONFIGS",
    "POD_COUNTERS",
    "PORT_LISTS",
    "CIDR_LISTS",
    "INBOUND_PODS",
    "INBOUND_LISTENERS",
    "HANDOFF",
    "ACCEL_COUNTERS",
    "LOOPBACK_DESTS",
];

/// The number of entries in one of a node's pinned maps.
#[must_use]
pub fn pinned_map_len(bpffs: &std::path::Path, map: &str) -> usize {
    let path = node_pin_dir(bpffs).join("maps").join(map);
    let out = crate::guards::run(
        Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(&path),
    );
    serde_json::from_str::<serde_json::Value>(out.trim())
        .ok()
        .and_then(|v| v.as_array().map(Vec::len))
        .unwrap_or(0)
}

/// Deletes up to `n` entries of one of a node's pinned maps (what an eviction would do) and
/// returns how many it deleted.
pub fn delete_pinned_map_entries(bpffs: &std::path::Path, map: &str, n: usize) -> usize {
    let path = node_pin_dir(bpffs).join("maps").join(map);
    let out = crate::guards::run(
        Command::new("bpftool")
            .args(["-j", "map", "dump", "pinned"])
            .arg(&path),
    );
    let entries: Vec<serde_json::Value> = serde_json::from_str(out.trim()).unwrap_or_default();
    let mut deleted = 0;
    for entry in entries.iter().take(n) {
        let key: Vec<String> = entry["key"]
            .as_array()
            .into_iter()
            .flatten()
            .filter_map(|b| b.as_str().map(str::to_string))
            .collect();
        crate::guards::run(
            Command::new("bpftool")
                .args(["map", "delete", "pinned"])
                .arg(&path)
                .arg("key")
                .args(&key),
        );
        deleted += 1;
    }
    deleted
}

/// Fills a node's `CIDR_LISTS` with `n` entries of a pod that does not exist (a netns cookie no
/// netns has), as many pods at their quotas would: one bpftool process for them all.
pub fn fill_cidr_lists(bpffs: &std::path::Path, n: u32) {
    use std::fmt::Write as _;
    let path = node_pin_dir(bpffs).join("maps").join("CIDR_LISTS");
    let mut batch = String::new();
    for i in 0..n {
        // prefix length 224 (every bit), then the key: cookie, list, family, pad, address.
        let mut key = vec![224u8, 0, 0, 0];
        key.extend_from_slice(&u64::MAX.to_ne_bytes());
        key.extend_from_slice(&[1, 4, 0, 0]);
        key.extend_from_slice(&i.to_be_bytes());
        key.extend_from_slice(&[0; 12]);
        let hex: Vec<String> = key.iter().map(|b| format!("0x{b:02x}")).collect();
        let _ = writeln!(
            batch,
            "map update pinned {} key {} value 0x01",
            path.display(),
            hex.join(" ")
        );
    }
    let file = std::env::temp_dir().join(format!("capture-fill-{}", std::process::id()));
    std::fs::write(&file, batch).expect("writing the bpftool batch");
    let out = Command::new("bpftool")
        .arg("batch")
        .arg("file")
        .arg(&file)
        .output()
        .expect("running bpftool");
    let _ = std::fs::remove_file(&file);
    assert!(
        out.status.success(),
        "bpftool batch: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}
