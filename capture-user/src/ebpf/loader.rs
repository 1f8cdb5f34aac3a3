//! The embedded BPF object: parsed, adapted to this kernel (found by loading, not from its
//! version), and each hook's program loaded with its refusal summarised in one line.

use std::path::{Path, PathBuf};

use aya::{
    programs::{Program, ProgramError},
    Ebpf, EbpfLoader,
};

use super::{
    btf_offsets::OwnerOffsets,
    hooks::{Hook, HOOKS},
    sizing::NodeSizing,
};

/// The kernel programs, built by build.rs from capture-ebpf.
static OBJECT: &[u8] = aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/capture.bpf.o"));

#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    #[error("this capture binary was built without kernel programs (CAPTURE_SKIP_EBPF_BUILD=1); rebuild it")]
    NoObject,
    #[error("parsing the embedded BPF object: {0}")]
    Parse(#[source] aya::EbpfError),
    #[error("the object has no program {0}")]
    MissingProgram(&'static str),
    #[error("the object has no map {0}")]
    MissingMap(&'static str),
    #[error("the kernel rejected {hook} (program {program}): {reason}; capture needs a kernel with BTF and this hook (see README, kernel requirements)")]
    Rejected {
        hook: &'static str,
        program: &'static str,
        reason: String,
    },
    #[error("the kernel could not load the programs with {features} after {attempts} tries ({reason}): it was short of memory or the load was interrupted, which says nothing about the programs; try again (the node's programs stay as they were)")]
    Interrupted {
        features: String,
        attempts: u32,
        reason: String,
    },
    #[error("pinning {path}: {source}")]
    Pin {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    #[error("opening pinned {path}: {source}; if the pins are damaged, run `capture detach` for every pod and remove the directory")]
    Adopt {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
    #[error("this node's programs are capture build {node}, and {pods} pod(s) use them; this is build {this}. Start this build's agent (it takes the node over in place, see README \"Upgrade and rollback\"), or use the `capture` binary of build {node}")]
    OtherBuild {
        node: String,
        this: String,
        pods: usize,
    },
    #[error("the node's map {map} has layout version {pinned}, which build {this} does not know (it knows version {known}); the node's programs (build {node}) stay in force. Run build {node} or a newer one")]
    NewerLayout {
        map: &'static str,
        pinned: u32,
        known: u32,
        node: String,
        this: String,
    },
    #[error("the node's map {map} (build {node}) cannot be carried into build {this}: {reason}; the node's programs stay in force. Run build {node}, or drain the node before this upgrade")]
    CannotCarry {
        map: &'static str,
        node: String,
        this: String,
        reason: String,
    },
    #[error("not loaded: no node record at {0}")]
    NotLoaded(PathBuf),
    #[error("taking over {path}: {source}")]
    Takeover {
        path: PathBuf,
        #[source]
        source: BoxError,
    },
}

/// The cause of a failure on a pinned object: the system call's, aya's, or the record's.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// Identifies the embedded object, so that pins from another build are recognised: FNV-1a of
/// its bytes, which build.rs computes once (at run time it cost every command a pass over a
/// megabyte).
#[must_use]
pub fn object_id() -> String {
    env!("CAPTURE_OBJECT_ID").to_string()
}

/// The build's name: the package version and the object's id (two builds of one version with
/// different kernel programs are different builds).
#[must_use]
pub fn build_name() -> String {
    format!("{}+{}", env!("CARGO_PKG_VERSION"), &object_id()[..12])
}

/// `CAPTURE_REFUSE_HOOKS=cgroup/recvmsg4,…` has capture treat those hooks as refused by the
/// kernel. Every kernel in the matrix has every hook, so this is how the tests reach the
/// per-pod fallback for a missing one; only builds with the `test-hooks` feature read it.
#[cfg(feature = "test-hooks")]
fn refused_for_testing(hook: &Hook) -> Option<String> {
    let list = std::env::var("CAPTURE_REFUSE_HOOKS").ok()?;
    list.split(',')
        .any(|h| h.trim() == hook.hook)
        .then(|| "refused through CAPTURE_REFUSE_HOOKS".to_string())
}

#[cfg(not(feature = "test-hooks"))]
fn refused_for_testing(_hook: &Hook) -> Option<String> {
    None
}

/// Whether `$var` is `1`, which switches a feature off as a kernel that refuses it would, so that
/// the tests reach the fallback on kernels that have it: `CAPTURE_RECORD_OWNERS` (owners recorded
/// at creation instead of read from the socket) and `CAPTURE_STATEFUL_REDIRECT` (every redirect
/// down the stateful path). Only builds with the `test-hooks` feature read them.
#[cfg(feature = "test-hooks")]
fn switched_off_for_testing(var: &str) -> bool {
    std::env::var_os(var).is_some_and(|v| v == "1")
}

#[cfg(not(feature = "test-hooks"))]
fn switched_off_for_testing(_var: &str) -> bool {
    false
}

/// Loads one hook's program, with the refusal summarised in one line.
pub(super) fn load_hook(ebpf: &mut Ebpf, hook: &Hook) -> Result<(), String> {
    if let Some(reason) = refused_for_testing(hook) {
        return Err(reason);
    }
    let program = ebpf
        .program_mut(hook.program)
        .ok_or_else(|| LoadError::MissingProgram(hook.program).to_string())?;
    load_program(hook, program).map_err(|e| summarize(&e))
}

/// How the object was adapted to this kernel: found by loading, not from its version.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct KernelFeatures {
    /// `sock_ops` may ask for the netns cookie (Linux 5.15+). Without it, a listener the proxy
    /// opened before capture was attached is not registered for inbound capture.
    pub sock_ops_netns_cookie: bool,
    /// The programs read a TCP socket's owner from the socket (its file's credentials, through
    /// the kernel's BTF) instead of recording it in socket-local storage when it is created.
    /// Needs `sock_ops_netns_cookie` (nothing else records the socket's netns then) and a
    /// verifier that lets `sock_addr` and `sock_ops` programs walk those structs.
    pub owner_from_file: bool,
    /// IPv4 TCP redirects go to a loopback address per original destination that says where
    /// they were going, with no per-connection state (`capture_common::loopback`). Needs
    /// `owner_from_file` (else every socket has storage anyway) and the netns cookie in the
    /// getsockopt program.
    pub stateless_redirect: bool,
}

/// The object's `.rodata` switches take their values from here (the loader borrows them).
static ON: u8 = 1;
static OFF: u8 = 0;

/// The object's definition of each map, as it would create them.
pub(super) fn object_maps() -> Result<std::collections::HashMap<String, aya_obj::Map>, LoadError> {
    if OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    aya_obj::Object::parse(OBJECT)
        .map(|o| o.maps)
        .map_err(|e| LoadError::Parse(aya::EbpfError::ParseError(e)))
}

/// Where each named map lives: a pinned map at that path is used as it is, and a map not yet
/// pinned there is created and pinned there.
pub(super) type MapPins = [(&'static str, PathBuf)];

fn switch(on: bool) -> &'static u8 {
    if on {
        &ON
    } else {
        &OFF
    }
}

fn parse_object(
    features: KernelFeatures,
    owner: &OwnerOffsets,
    map_pins: &MapPins,
    sizing: NodeSizing,
) -> Result<Ebpf, LoadError> {
    if OBJECT.is_empty() {
        return Err(LoadError::NoObject);
    }
    let mut loader = EbpfLoader::new();
    // A map pinned already keeps its own capacity: the loader uses the pin as it is.
    for (map, entries) in sizing.capacities() {
        loader.map_max_entries(map.name(), entries);
    }
    loader.override_global(
        "SOCK_OPS_NETNS_COOKIE",
        switch(features.sock_ops_netns_cookie),
        true,
    );
    loader.override_global("OWNER_FROM_FILE", switch(features.owner_from_file), true);
    loader.override_global(
        "STATELESS_REDIRECT",
        switch(features.stateless_redirect),
        true,
    );
    // CAPTURE_WITHOUT_TRACE=1 loads the node's programs without tracing: the benchmark's
    // ebpf-notrace measures them so (the verifier prunes the trace code), and a node that must
    // not have it can say so.
    loader.override_global(
        "TRACE_BUILT_IN",
        switch(std::env::var_os("CAPTURE_WITHOUT_TRACE").is_none_or(|v| v != "1")),
        true,
    );
    for (name, offset) in [
        ("OWNER_OFFSET_SOCK_SK_SOCKET", &owner.sock_sk_socket),
        ("OWNER_OFFSET_SOCKET_FILE", &owner.socket_file),
        ("OWNER_OFFSET_FILE_F_CRED", &owner.file_f_cred),
        ("OWNER_OFFSET_CRED_FSUID", &owner.cred_fsuid),
        ("OWNER_OFFSET_CRED_FSGID", &owner.cred_fsgid),
    ] {
        loader.override_global(name, offset, true);
    }
    for (name, path) in map_pins {
        loader.map_pin_path(name, Path::new(path));
    }
    loader.load(OBJECT).map_err(LoadError::Parse)
}

/// How the object must be adapted to this kernel (loads the deciding programs up to four times,
/// nothing else).
pub fn kernel_features() -> Result<KernelFeatures, LoadError> {
    adapted_object(&[], NodeSizing::PROBE).map(|(_, features)| features)
}

/// The programs whose loading decides the features: every switch is read by one of them.
const DECIDING_PROGRAMS: [&str; 4] = [
    "capture_sock_ops",
    "capture_connect4",
    "capture_getsockopt",
    "capture_getpeername4",
];

/// Why the deciding programs did not load.
struct Refusal {
    reason: String,
    /// The kernel said nothing about the programs (`TRANSIENT_LOAD_ERRORS`).
    transient: bool,
}

/// What a program load can meet that says nothing about the program: the verifier interrupted by
/// a signal (`EAGAIN`), the kernel short of memory, a busy resource. Taken as a refusal, one of
/// these would switch a feature off for the node's whole life on a kernel that has it.
const TRANSIENT_LOAD_ERRORS: [i32; 4] = [libc::EAGAIN, libc::EINTR, libc::ENOMEM, libc::EBUSY];

/// How often a program's load is tried again after a transient error, waiting 20, 40, 80 and
/// 160 ms.
const TRANSIENT_LOAD_RETRIES: u32 = 4;

fn is_transient(e: &ProgramError) -> bool {
    let errno = match e {
        ProgramError::LoadError { io_error, .. } => io_error.raw_os_error(),
        ProgramError::SyscallError(e) => e.io_error.raw_os_error(),
        _ => None,
    };
    errno.is_some_and(|n| TRANSIENT_LOAD_ERRORS.contains(&n))
}

/// Loads the programs that decide the features; the first refusal, summarised.
fn load_deciding(ebpf: &mut Ebpf) -> Result<(), Refusal> {
    for name in DECIDING_PROGRAMS {
        let hook = HOOKS
            .iter()
            .find(|h| h.program == name)
            .expect("the deciding programs are hooks");
        let program = ebpf.program_mut(hook.program).ok_or_else(|| Refusal {
            reason: LoadError::MissingProgram(hook.program).to_string(),
            transient: false,
        })?;
        load_program(hook, program).map_err(|e| Refusal {
            reason: format!("{name}: {}", summarize(&e)),
            transient: is_transient(&e),
        })?;
    }
    Ok(())
}

/// The object, with the deciding programs already loaded: with every switch on where the kernel
/// takes it, else without what it refuses, down to no switch on.
pub(super) fn adapted_object(
    map_pins: &MapPins,
    sizing: NodeSizing,
) -> Result<(Ebpf, KernelFeatures), LoadError> {
    let owner = if switched_off_for_testing("CAPTURE_RECORD_OWNERS") {
        Err("CAPTURE_RECORD_OWNERS=1".to_string())
    } else {
        OwnerOffsets::of_running_kernel()
    };
    if let Err(e) = &owner {
        tracing::debug!("owners are recorded at socket creation: {e}");
    }
    let candidates = [
        KernelFeatures {
            sock_ops_netns_cookie: true,
            owner_from_file: owner.is_ok(),
            stateless_redirect: owner.is_ok()
                && !switched_off_for_testing("CAPTURE_STATEFUL_REDIRECT"),
        },
        KernelFeatures {
            sock_ops_netns_cookie: true,
            owner_from_file: owner.is_ok(),
            stateless_redirect: false,
        },
        KernelFeatures {
            sock_ops_netns_cookie: true,
            owner_from_file: false,
            stateless_redirect: false,
        },
        KernelFeatures {
            sock_ops_netns_cookie: false,
            owner_from_file: false,
            stateless_redirect: false,
        },
    ];
    let offsets = owner.unwrap_or_default();
    let mut last = None;
    for features in candidates {
        if last.as_ref().is_some_and(|(_, tried)| *tried == features) {
            continue;
        }
        let mut ebpf = parse_object(features, &offsets, map_pins, sizing)?;
        match load_deciding(&mut ebpf) {
            Ok(()) => return Ok((ebpf, features)),
            // The node must not run for good without a feature its kernel has.
            Err(refusal) if refusal.transient => {
                return Err(LoadError::Interrupted {
                    features: format!("{features:?}"),
                    attempts: TRANSIENT_LOAD_RETRIES + 1,
                    reason: refusal.reason,
                })
            }
            Err(Refusal { reason: e, .. }) => {
                // Expected on older kernels, at every probe: status says what the node runs
                // with (`node_features`).
                tracing::debug!(reason = %e, ?features, "the kernel refused the programs with these features; trying with fewer");
                last = Some((ebpf, features));
            }
        }
    }
    // Nothing loaded even without any switch: the hooks' own loading reports why.
    Ok(last.expect("at least one candidate was tried"))
}

/// Loads a program unless it is loaded already, trying again while the kernel's answer is
/// transient.
fn load_program(hook: &Hook, program: &mut Program) -> Result<(), ProgramError> {
    if program.fd().is_ok() {
        return Ok(());
    }
    let mut attempt = 0;
    loop {
        match load_once(hook, program) {
            Err(e) if is_transient(&e) && attempt < TRANSIENT_LOAD_RETRIES => {
                tracing::info!(program = hook.program, error = %e, "the kernel could not load the program for now; trying again");
                std::thread::sleep(std::time::Duration::from_millis(20 << attempt));
                attempt += 1;
            }
            result => return result,
        }
    }
}

fn load_once(hook: &Hook, program: &mut Program) -> Result<(), ProgramError> {
    match program {
        Program::CgroupSockAddr(p) => p.load(),
        Program::CgroupSock(p) => p.load(),
        Program::SockOps(p) => p.load(),
        Program::CgroupSockopt(p) => p.load(),
        Program::SkLookup(p) => p.load(),
        _ => unreachable!("{} has an unexpected program type", hook.program),
    }
}

/// One line from a load failure: the errno, and the verifier's last complaint (the whole log goes
/// to the debug log).
pub(super) fn summarize(e: &ProgramError) -> String {
    match e {
        ProgramError::LoadError {
            io_error,
            verifier_log,
        } => {
            let log = verifier_log.to_string();
            tracing::debug!("verifier log:\n{log}");
            let complaint = log
                .lines()
                .map(str::trim)
                .filter(|l| !l.is_empty())
                .take_while(|l| !l.starts_with("verification time") && !l.starts_with("processed "))
                .last()
                .unwrap_or("no verifier output");
            format!("{io_error}; verifier: {complaint}")
        }
        other => other.to_string(),
    }
}

/// The license an object declares to the kernel: its `license` section (aya-obj assumes "GPL"
/// where there is none).
#[cfg(test)]
pub(super) fn declared_license(object: &[u8]) -> String {
    assert!(!object.is_empty(), "the kernel object was not built");
    aya_obj::Object::parse(object)
        .expect("the object parses")
        .license
        .into_string()
        .expect("an ASCII license")
}

/// The strings the kernel takes as GPL-compatible (`license_is_gpl_compatible`,
/// include/linux/license.h).
#[cfg(test)]
pub(super) const GPL_COMPATIBLE: [&str; 6] = [
    "GPL",
    "GPL v2",
    "GPL and additional rights",
    "Dual BSD/GPL",
    "Dual MIT/GPL",
    "Dual MPL/GPL",
];

#[cfg(test)]
mod tests {
    use capture_common::layout::MapId;

    /// An interrupted verifier or a kernel short of memory is tried again; the verifier's own
    /// refusals (`EINVAL`, `EACCES`, `E2BIG`) are what the features are decided by.
    #[test]
    fn only_errors_that_say_nothing_about_the_program_are_transient() {
        let failed = |errno| {
            aya::programs::ProgramError::SyscallError(aya::sys::SyscallError {
                call: "bpf_prog_load",
                io_error: std::io::Error::from_raw_os_error(errno),
            })
        };
        for errno in [libc::EAGAIN, libc::EINTR, libc::ENOMEM, libc::EBUSY] {
            assert!(super::is_transient(&failed(errno)), "errno {errno}");
        }
        for errno in [
            libc::EINVAL,
            libc::EACCES,
            libc::E2BIG,
            libc::EPERM,
            libc::ENOTSUP,
        ] {
            assert!(!super::is_transient(&failed(errno)), "errno {errno}");
        }
    }

    /// The object's maps are the registry's, with the registry's key and value sizes: a map
    /// added to the kernel side without its entry (or the reverse) fails here.
    #[test]
    fn the_objects_maps_are_the_registrys() {
        let maps = super::object_maps().expect("the object's maps");
        let mut declared: Vec<&str> = maps
            .keys()
            .map(String::as_str)
            .filter(|name| !name.starts_with('.'))
            .collect();
        declared.sort_unstable();
        let mut registry: Vec<&str> = MapId::ALL.iter().map(|m| m.name()).collect();
        registry.sort_unstable();
        assert_eq!(declared, registry);
        for map in MapId::ALL {
            let definition = &maps[map.name()];
            assert_eq!(
                (
                    definition.key_size() as usize,
                    definition.value_size() as usize
                ),
                map.sizes(),
                "{}",
                map.name()
            );
            // The loader scales these for --max-pods from what the object declares.
            if let Some(capacity) = map.declared_capacity() {
                assert_eq!(definition.max_entries(), capacity, "{}", map.name());
            }
        }
    }

    /// The object says its license itself, and one the kernel takes as GPL-compatible: the
    /// owner-from-file and stateless-redirect programs do not load otherwise.
    #[test]
    fn the_object_declares_its_gpl_compatible_license() {
        let license = super::declared_license(super::OBJECT);
        assert_eq!(license, "Dual MIT/GPL");
        assert!(super::GPL_COMPATIBLE.contains(&license.as_str()));
    }
}
