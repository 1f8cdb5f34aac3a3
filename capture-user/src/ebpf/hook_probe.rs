//! The probe behind `auto` mode and `capture doctor`: every program of the embedded object is
//! loaded (program type and helpers meet the verifier) and linked to a scratch cgroup or netns
//! (attach types are tried), then all of it is dropped again.

use std::{fs::File, os::fd::AsFd as _};

use aya::Ebpf;

use super::{
    hooks::{Hook, Target, HOOKS},
    loader::{adapted_object, load_hook, KernelFeatures, LoadError},
    sys,
};

/// One hook's load-and-verify result.
pub type HookProbe = (Hook, Result<(), String>);

/// Where the probe attaches programs: a scratch cgroup and a scratch netns that no traffic
/// uses, both gone when this drops.
struct ProbeTargets {
    cgroup: File,
    _scratch: crate::cgroup::ScratchCgroup,
    netns: File,
}

impl ProbeTargets {
    fn create() -> std::io::Result<Self> {
        let scratch = crate::cgroup::ScratchCgroup::create("probe")?;
        let cgroup = File::open(&scratch.path)?;
        // A thread that leaves for a new netns takes nothing else with it; the netns lives on
        // while the file is open.
        let netns = std::thread::spawn(|| {
            nix::sched::unshare(nix::sched::CloneFlags::CLONE_NEWNET)?;
            File::open("/proc/thread-self/ns/net")
        })
        .join()
        .map_err(|_| std::io::Error::other("the probe's netns thread panicked"))??;
        Ok(Self {
            cgroup,
            _scratch: scratch,
            netns,
        })
    }
}

/// Links a loaded program to its kind of target and unlinks it again (the link closes).
fn attach_hook(ebpf: &Ebpf, hook: &Hook, targets: &ProbeTargets) -> Result<(), String> {
    let fd = ebpf
        .program(hook.program)
        .ok_or_else(|| LoadError::MissingProgram(hook.program).to_string())?
        .fd()
        .map_err(|e| e.to_string())?;
    let target = match hook.target {
        Target::Cgroup => targets.cgroup.as_fd(),
        Target::Netns => targets.netns.as_fd(),
    };
    sys::link_create(fd.as_fd(), target, hook.attach_type)
        .map(drop)
        .map_err(|e| format!("loads, but attaching it fails: {e}"))
}

/// Loads every program of the embedded object into the kernel and links each to a scratch
/// cgroup or netns (and drops it all again): the probe of program types, helpers and attach
/// types, one result per hook, and how the object had to be adapted.
#[must_use]
pub fn probe_programs() -> (Vec<HookProbe>, Option<KernelFeatures>) {
    let (mut ebpf, features) = match adapted_object(&[], super::sizing::NodeSizing::PROBE) {
        Ok(loaded) => loaded,
        Err(e) => {
            let results = HOOKS.iter().map(|h| (*h, Err(e.to_string()))).collect();
            return (results, None);
        }
    };
    let targets = ProbeTargets::create();
    let results = HOOKS
        .iter()
        .map(|hook| {
            let result = load_hook(&mut ebpf, hook).and_then(|()| match &targets {
                Ok(targets) => attach_hook(&ebpf, hook, targets),
                Err(e) => Err(format!(
                    "loads, but no scratch cgroup/netns to attach it to: {e}"
                )),
            });
            (*hook, result)
        })
        .collect();
    (results, Some(features))
}
