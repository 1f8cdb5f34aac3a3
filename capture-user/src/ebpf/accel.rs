//! The node's part of the app-to-proxy acceleration: the `sk_msg` program, loaded with the node's
//! programs and attached to `ACCEL_PEERS`. Optional: a kernel that refuses it serves every pod,
//! unaccelerated, and says why.

use std::{os::fd::AsFd as _, path::Path};

use aya::{
    maps::MapData,
    programs::{ProgramError, SkMsg},
    Ebpf,
};
use aya_obj::generated::bpf_attach_type::BPF_SK_MSG_VERDICT;

use super::{hooks::UnavailableHook, sys};

/// The program's name in the object.
pub const PROGRAM: &str = "capture_accel_msg";
/// How status and the node record name it among the hooks the kernel refused.
pub const HOOK: &str = "sk_msg";

/// Loads the `sk_msg` program, pins it in `programs_dir` and attaches it to `ACCEL_PEERS`.
pub(super) fn load_and_attach(ebpf: &mut Ebpf, programs_dir: &Path) -> Result<(), String> {
    let map_fd = {
        let map = ebpf
            .map(capture_common::layout::MapId::AccelPeers.name())
            .ok_or("the object has no ACCEL_PEERS map")?;
        let data: &MapData = match map {
            aya::maps::Map::SockHash(d) => d,
            _ => return Err("ACCEL_PEERS is not a sockhash".into()),
        };
        data.fd()
            .as_fd()
            .try_clone_to_owned()
            .map_err(|e| e.to_string())?
    };
    let program: &mut SkMsg = ebpf
        .program_mut(PROGRAM)
        .ok_or("the object has no sk_msg program")?
        .try_into()
        .map_err(|e: ProgramError| e.to_string())?;
    program.load().map_err(|e| super::loader::summarize(&e))?;
    let path = programs_dir.join(PROGRAM);
    program
        .pin(&path)
        .map_err(|e| format!("pinning {}: {e}", path.display()))?;
    let prog_fd = program.fd().map_err(|e| e.to_string())?;
    sys::prog_attach_to_map(prog_fd.as_fd(), map_fd.as_fd(), BPF_SK_MSG_VERDICT as u32)
        .map_err(|e| format!("attaching to ACCEL_PEERS: {e}"))
}

/// The refusal of the `sk_msg` program, if the node record has one.
#[must_use]
pub fn refusal(unavailable: &[UnavailableHook]) -> Option<&UnavailableHook> {
    unavailable.iter().find(|u| u.hook == HOOK)
}
