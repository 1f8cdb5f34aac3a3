//! The guest's second stage: a bash script run as PID 1 on the host's root (shared read-only). It
//! prepares what the tests expect of a node, runs each test binary with its output on the serial
//! console, and frames it with `capture-vm:` lines that results.rs parses.
//!
//! It lives under target/vm. The guest mounts a fresh tmpfs on /tmp; /init keeps a workspace
//! that is under the host's /tmp (a CI clone) visible at its path.

use std::{fs, path::Path};

use anyhow::{Context as _, Result};

use super::model::TestBinary;

/// Node set-up before the tests. /tmp/kroot is the guest kernel's own module tree (mounted by
/// /init); pointing the kernel's modprobe helper at it lets netfilter and friends autoload.
const PRELUDE: &str = r#"#!/bin/bash
# Stage 2 of `cargo xtask vm` (generated; rewritten on every run).
set -u
say() { echo "capture-vm: $*"; }
say "kernel $(uname -r)"
export PATH=__PATH__ HOME=/tmp
mount -t tmpfs run /run || say "cannot mount /run"
mkdir -p /run/lock
mount -t bpf bpf /sys/fs/bpf || say "cannot mount bpffs"
mount -t cgroup2 cgroup2 /sys/fs/cgroup || say "cannot mount cgroup2"
mkdir -p /dev/shm && mount -t tmpfs shm /dev/shm
# containerd 1.6's CNI library caches each network's result under /var/lib/cni, which its
# configuration cannot move; the host's root is read-only here.
mount -t tmpfs varlib /var/lib || say "cannot mount /var/lib"
printf '#!/bin/sh\nexec /usr/sbin/modprobe -d /tmp/kroot "$@"\n' > /tmp/modprobe
chmod +x /tmp/modprobe
echo /tmp/modprobe > /proc/sys/kernel/modprobe
for m in veth bridge; do /tmp/modprobe "$m" || say "modprobe $m failed"; done
ip link set lo up
export CAPTURE_SKIP_LOG=/tmp/capture-skips
# Facts of this kernel and build the tests learn once per VM, not once per binary.
export CAPTURE_TEST_CACHE=/tmp/capture-test-cache
# Tests may change what only a disposable machine may change (kernel_compat's nsdelegate).
export CAPTURE_VM_GUEST=1
# Emulated CPUs: the load tests run smaller (their full sizes run on the host).
export CAPTURE_CONCURRENT_CONNECTIONS=8000
export CAPTURE_CHAOS_PODS=10 CAPTURE_CHAOS_KILLS=5 CAPTURE_CHAOS_CYCLES=60
: > "$CAPTURE_SKIP_LOG"
run_binary() {
    local name=$1
    shift
    say "begin $name"
    "$@" 2>&1
    local rc=$?
    say "end $name rc=$rc"
    report_skips
}
# The skips of the binary that just ended, right after its end line (results.rs attributes them
# to it), then a fresh log for the next.
report_skips() {
    while IFS= read -r line; do printf 'capture-skip: %s\n' "$line"; done < "$CAPTURE_SKIP_LOG"
    : > "$CAPTURE_SKIP_LOG"
}
"#;

/// Powers off (sysrq works whatever the sysrq mask says when written
/// from /proc; should it not, bash exiting as PID 1 panics and `panic=-1` reboots, which qemu's
/// `-no-reboot` turns into an exit).
const EPILOGUE: &str = r"say done
echo o > /proc/sysrq-trigger
sleep 30
";

/// Writes the stage-2 script that runs `binaries` from `tests_dir` with `filter`'s flags, and
/// only `backends` (all when empty) where a test runs every backend. `on_host_root`: the guest
/// runs on this machine's root, not another architecture's.
pub fn write(
    path: &Path,
    tests_dir: &Path,
    binaries: &[&TestBinary],
    filter: &[String],
    backends: &[String],
    on_host_root: bool,
) -> Result<()> {
    // On the host's root, the host's PATH, so the guest finds the same tools (python3 with its
    // modules among them); another root has Debian's directories only.
    let host_path = if on_host_root {
        std::env::var("PATH").unwrap_or_default() + ":"
    } else {
        String::new()
    };
    let guest_path =
        format!("{host_path}/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin");
    let mut script = PRELUDE.replace("__PATH__", &quote(&guest_path));
    if !backends.is_empty() {
        script.push_str(&format!(
            "export CAPTURE_TEST_BACKENDS={}\n",
            quote(&backends.join(","))
        ));
    }
    script.push_str(&format!("cd {}\n", quote(&tests_dir.to_string_lossy())));
    for binary in binaries {
        let mut line = format!(
            "run_binary {} {}",
            quote(&binary.name),
            quote(&binary.path.to_string_lossy())
        );
        for arg in binary.run_args(filter) {
            line.push(' ');
            line.push_str(&quote(&arg));
        }
        script.push_str(&line);
        script.push('\n');
    }
    script.push_str(EPILOGUE);
    fs::write(path, script).with_context(|| format!("writing {}", path.display()))
}

/// `s` as one single-quoted shell word.
fn quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_backends_asked_for_reach_the_tests_and_none_asked_means_every_one() {
        let dir = std::env::temp_dir().join(format!("capture-stage2-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let script = dir.join("stage2.sh");
        let binary = TestBinary {
            name: "outbound".into(),
            tier: "hooks".into(),
            path: "/x/hooks".into(),
            tests: vec!["default_sidecar".into()],
        };
        write(&script, &dir, &[&binary], &[], &["ebpf".into()], true).unwrap();
        let text = fs::read_to_string(&script).unwrap();
        assert!(
            text.contains("export CAPTURE_TEST_BACKENDS='ebpf'\n"),
            "{text}"
        );
        write(&script, &dir, &[&binary], &[], &[], false).unwrap();
        let text = fs::read_to_string(&script).unwrap();
        assert!(!text.contains("CAPTURE_TEST_BACKENDS"), "{text}");
        // Another architecture's root: none of this machine's directories on its PATH.
        assert!(
            text.contains(
                "export PATH='/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin'"
            ),
            "{text}"
        );
        fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn quoting_survives_quotes_and_spaces() {
        assert_eq!(quote("a b"), "'a b'");
        assert_eq!(quote("it's"), r"'it'\''s'");
    }
}
