//! Every external command the tasks, the tests and the capture binaries run, with the Debian
//! package that provides it. Setup installs a tool's package when dpkg does not list it as
//! installed, then checks that the command itself is there; a unit test keeps this table in step
//! with every `Command::new` of a literal program name in the tree.

use std::{
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
};

/// A command the code runs, and where it comes from.
#[derive(Clone, Copy, Debug)]
pub struct Tool {
    /// As the code runs it: a name looked up on PATH, or an absolute path.
    pub command: &'static str,
    /// The Debian package that provides it.
    pub package: &'static str,
}

const fn tool(command: &'static str, package: &'static str) -> Tool {
    Tool { command, package }
}

/// What `cargo xtask test`, `demo` and `bench` run, directly or through the capture binaries (the
/// iptables backend runs the restore/save tools inside the pod netns with nsenter). The reference
/// CNI plugins are run by path: the CNI tests chain capture-cni after them. promtool lints the
/// agent's /metrics in the CNI tests, and a Prometheus server scrapes a running agent in the
/// metrics test (its unit stays masked: see services.rs; the test starts its own).
pub const TEST_TOOLS: &[Tool] = &[
    tool("ip", "iproute2"),
    tool("bpftool", "bpftool"),
    tool("iptables-restore", "iptables"),
    tool("ip6tables-restore", "iptables"),
    tool("iptables-save", "iptables"),
    tool("ip6tables-save", "iptables"),
    // The node's own variant, when it holds nft or legacy rules (iptables/flavour.rs).
    tool("iptables-nft-restore", "iptables"),
    tool("iptables-nft-save", "iptables"),
    tool("ip6tables-nft-restore", "iptables"),
    tool("ip6tables-nft-save", "iptables"),
    tool("iptables-legacy-restore", "iptables"),
    tool("iptables-legacy-save", "iptables"),
    tool("ip6tables-legacy-restore", "iptables"),
    tool("ip6tables-legacy-save", "iptables"),
    // The nftables backend (nftables/apply.rs) and --fallback auto's look at the node's tables.
    tool("nft", "nftables"),
    tool("nsenter", "util-linux"),
    // capture reads a user-namespaced pod's id maps from inside its namespace (userns.rs).
    tool("cat", "coreutils"),
    // The release test verifies SHA256SUMS as a user would.
    tool("sha256sum", "coreutils"),
    tool("sysctl", "procps"),
    tool("/usr/lib/cni/bridge", "containernetworking-plugins"),
    tool("/usr/lib/cni/host-local", "containernetworking-plugins"),
    // The image test runs the arm64 image's programs from its root under user-mode emulation
    // (named on the command line: qemu-user registers no binfmt handler).
    tool("qemu-aarch64", "qemu-user"),
    tool("promtool", "prometheus"),
    tool("prometheus", "prometheus"),
    // The upgrade tests build the previous release from the repository's history.
    tool("git", "git"),
    tool("tar", "tar"),
    // The containerd tests: the runtime (started through nsenter in the test's node netns), the
    // OCI runtime it runs containers with, ctr to import the hand-written images, ldd to find
    // what the probe binary in those images loads and strip to leave its debug information out.
    // The CRI client crate's build script compiles the CRI protobuf definitions with protoc.
    // containerd's unit stays masked (services.rs).
    tool("containerd", "containerd"),
    tool("runc", "runc"),
    tool("ctr", "containerd"),
    tool("ldd", "libc-bin"),
    tool("strip", "binutils"),
    tool("protoc", "protobuf-compiler"),
    // The systemd cgroup driver's test: systemd as PID 1 of namespaces that unshare makes (from
    // a bash script), driven with systemctl.
    tool("unshare", "util-linux"),
    // The capabilities tests run the agent and the CLI with a cut bounding set.
    tool("setpriv", "util-linux"),
    tool("bash", "bash"),
    tool("/lib/systemd/systemd", "systemd"),
    tool("systemctl", "systemd"),
    // A real transparent proxy as a pod's sidecar (tests/tests/hooks/haproxy.rs), run inside the pod
    // through the probe; its unit stays masked (services.rs).
    tool("haproxy", "haproxy"),
    // What a CNI ADD starts is counted by following the agent (tests/tests/node/cni/spawns.rs).
    tool("strace", "strace"),
    // `cargo xtask ci` rebuilds the image beside the tests in the idle scheduling class.
    tool("chrt", "util-linux"),
];

/// What `cargo xtask vm` adds on the host: apt and dpkg fetch and unpack the kernels, kmod
/// resolves their modules, xz and zstd decompress them, a static busybox is the initramfs's
/// userland, qemu boots it under TCG, and the guest's second stage is a bash script that mounts
/// its filesystems with the host's own tools.
pub const VM_TOOLS: &[Tool] = &[
    tool("apt-get", "apt"),
    tool("apt-cache", "apt"),
    tool("dpkg-deb", "dpkg"),
    tool("depmod", "kmod"),
    tool("modprobe", "kmod"),
    tool("xz", "xz-utils"),
    tool("zstd", "zstd"),
    tool("busybox", "busybox-static"),
    tool("qemu-system-x86_64", "qemu-system-x86"),
    // The arm64 kernels (`cargo xtask vm --kernels 6.1-arm64`).
    tool("qemu-system-aarch64", "qemu-system-arm"),
    tool("bash", "bash"),
    tool("mount", "mount"),
];

/// What `cargo xtask setup-check` runs to make and enter a clean Debian root.
pub const CHECK_TOOLS: &[Tool] = &[
    tool("debootstrap", "debootstrap"),
    tool("chroot", "coreutils"),
    tool("mount", "mount"),
    tool("umount", "mount"),
];

/// Commands that come with the machine rather than from setup: rustup and cargo install the
/// toolchains and bpf-linker, python3 with pip installs kubernetes-validate, dpkg and apt install
/// everything else. Setup checks them first and names what to install when one is missing.
pub const PREREQUISITES: &[(&str, &str)] = &[
    (
        "rustup",
        "install rustup (https://rustup.rs), then run this again",
    ),
    ("cargo", "install a Rust toolchain with rustup"),
    (
        "python3",
        "install python3 with pip (Debian: apt-get install python3 python3-pip)",
    ),
    (
        "dpkg-query",
        "setup installs Debian packages: run on Debian (or install dpkg and apt)",
    ),
    (
        "apt-get",
        "setup installs Debian packages: run on Debian (or install apt)",
    ),
];

/// The distinct packages of `tools`, in table order.
pub fn packages(tools: &[Tool]) -> Vec<&'static str> {
    let mut packages: Vec<&'static str> = Vec::new();
    for tool in tools {
        if !packages.contains(&tool.package) {
            packages.push(tool.package);
        }
    }
    packages
}

/// Where `command` would run from: itself when it is a path, else the first executable file of
/// that name on PATH (with the sbin directories a non-login root shell may lack).
pub fn find(command: &str) -> Option<PathBuf> {
    if command.contains('/') {
        return Some(PathBuf::from(command)).filter(|p| is_executable(p));
    }
    let path = std::env::var("PATH").unwrap_or_default();
    let found = path
        .split(':')
        .chain(["/usr/local/sbin", "/usr/sbin", "/sbin"])
        .filter(|dir| !dir.is_empty())
        .map(|dir| Path::new(dir).join(command))
        .find(|p| is_executable(p));
    found
}

fn is_executable(path: &Path) -> bool {
    path.metadata()
        .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
}

#[cfg(test)]
mod tests {
    use std::{collections::BTreeSet, fs};

    use super::*;

    /// Commands run by a name held in a variable, each listed here with the table entry or
    /// installer that covers it.
    const INDIRECT: &[&str] = &[
        // setup's own check of bpf-linker's version; setup builds it with cargo install.
        "bpf-linker",
        // the toolchain's compiler, installed with it by rustup.
        "rustc",
    ];

    /// Every program name given to `Command::new` as a string literal in the workspace's sources.
    fn literal_commands(dir: &Path, found: &mut BTreeSet<String>) {
        for entry in fs::read_dir(dir).unwrap().filter_map(Result::ok) {
            let path = entry.path();
            let name = entry.file_name();
            if path.is_dir() && name != "target" && !name.to_string_lossy().starts_with('.') {
                literal_commands(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") {
                let text = fs::read_to_string(&path).unwrap();
                for piece in text.split("Command::new(\"").skip(1) {
                    let command = piece.split('"').next().unwrap();
                    // Binaries the workspace builds itself are run by relative path.
                    if !command.starts_with("target/") {
                        found.insert(command.to_string());
                    }
                }
            }
        }
    }

    #[test]
    fn every_command_the_code_runs_is_installed_or_checked() {
        let workspace = Path::new(env!("CARGO_MANIFEST_DIR")).parent().unwrap();
        let mut found = BTreeSet::new();
        literal_commands(workspace, &mut found);
        assert!(
            found.contains("nsenter"),
            "the scan finds nothing: {found:?}"
        );
        let known: BTreeSet<&str> = [TEST_TOOLS, VM_TOOLS, CHECK_TOOLS]
            .concat()
            .iter()
            .map(|t| t.command)
            .chain(PREREQUISITES.iter().map(|(command, _)| *command))
            .chain(INDIRECT.iter().copied())
            .collect();
        let unknown: Vec<&String> = found
            .iter()
            .filter(|c| !known.contains(c.as_str()))
            .collect();
        assert!(
            unknown.is_empty(),
            "commands run by the code that setup neither installs nor checks: {unknown:?} \
             (add them to xtask/src/setup/tools.rs)"
        );
    }

    #[test]
    fn packages_are_listed_once_in_table_order() {
        assert_eq!(
            packages(&[tool("a", "p1"), tool("b", "p2"), tool("c", "p1")]),
            ["p1", "p2"]
        );
    }

    #[test]
    fn find_takes_paths_as_they_are_and_names_from_path() {
        assert_eq!(find("/bin/sh"), Some(PathBuf::from("/bin/sh")));
        assert_eq!(find("/nonexistent/tool"), None);
        assert!(find("sh").is_some());
        assert_eq!(find("capture-no-such-command"), None);
    }
}
