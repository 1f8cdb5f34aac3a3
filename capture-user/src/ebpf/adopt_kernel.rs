//! Listener adoption done by the kernel, for an agent whose PID namespace does not hold the
//! pod's processes (a DaemonSet without `hostPID`): it cannot take their descriptors, so the
//! listeners `sock_diag` lists are registered by capture-ebpf's `adopt-listeners` program, run
//! inside the pod's netns (`capture_common::adopt` says how).

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
    path::Path,
};

use aya::{
    programs::{SchedClassifier, TestRun as _, TestRunOptions},
    Ebpf, EbpfLoader,
};
use capture_common::{
    adopt::{
        AdoptAnswer, AdoptRequest, ACTION_INBOUND, ACTION_OUTBOUND, ANSWER_OFFSET, OUTCOME_ALREADY,
        OUTCOME_MAP_REFUSED, OUTCOME_NOT_FOUND, OUTCOME_NO_STATE, OUTCOME_REGISTERED,
        OUTCOME_SLOTS_FULL, PACKET_LEN, REQUEST_OFFSET,
    },
    layout::MapId,
    AF_INET, AF_INET6,
};
use netlink_packet_sock_diag::inet::StateFlags;

use super::adopt::{accepts_inbound, AdoptError, Adopted};
use crate::{backend::PodTarget, config::CaptureConfig, netns::Netns, sockdiag};

/// The adopter, built by build.rs from capture-ebpf's `adopt-listeners` binary.
static OBJECT: &[u8] =
    aya::include_bytes_aligned!(concat!(env!("OUT_DIR"), "/adopt-listeners.bpf.o"));

/// Lookups per member of a listener group before the adopter stops looking for the members it
/// has not met: each lookup meets one member at random, so missing one of eight after 64 each is
/// about as likely as (7/8)^512.
const LOOKUPS_PER_MEMBER: usize = 64;
/// The first source port of the lookups (any port does; they only spread over a group).
const FIRST_SOURCE_PORT: u16 = 20_000;
/// The adopter's program in its object.
const PROGRAM: &str = "adopt_listener";

/// Listeners of one address and port, the same family (one socket, or a `SO_REUSEPORT` group).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
struct Group {
    action: u32,
    ipv6: bool,
    local: SocketAddr,
}

/// Registers the pod's listeners on its inbound and outbound ports, as `adopt_listeners` does
/// with descriptors. A listener registered before (by the kernel at `listen()`) is left as it is.
pub(super) fn adopt_in_kernel(
    maps_dir: &Path,
    pod: &PodTarget<'_>,
    cfg: &CaptureConfig,
) -> Result<Adopted, AdoptError> {
    let netns = Netns::open(pod.netns_path).map_err(|e| kernel_error(pod, e))?;
    let listeners =
        sockdiag::tcp_sockets(&netns, StateFlags::LISTEN).map_err(|e| kernel_error(pod, e))?;
    let mut groups: BTreeMap<Group, usize> = BTreeMap::new();
    for socket in listeners {
        let port = socket.local.port();
        let action = if port == cfg.inbound_port && accepts_inbound(socket.local.ip(), cfg) {
            ACTION_INBOUND
        } else if port == cfg.outbound_port {
            ACTION_OUTBOUND
        } else {
            continue;
        };
        let group = Group {
            action,
            ipv6: socket.ipv6,
            local: socket.local,
        };
        *groups.entry(group).or_default() += 1;
    }
    if groups.is_empty() {
        return Ok(Adopted::default());
    }
    let ebpf = load(maps_dir).map_err(|e| kernel_error(pod, e))?;
    let program = adopter(&ebpf).map_err(|e| kernel_error(pod, e))?;
    let result = netns
        .run_in(|| {
            let mut adopted = Adopted::default();
            for (group, members) in &groups {
                let registered = adopt_group(program, pod.netns_cookie, *group, *members)?;
                if group.action == ACTION_INBOUND {
                    adopted.inbound += registered;
                } else {
                    adopted.outbound += registered;
                }
            }
            Ok::<_, String>(adopted)
        })
        .map_err(|e| kernel_error(pod, e))?;
    result.map_err(|e| kernel_error(pod, e))
}

fn kernel_error(pod: &PodTarget<'_>, e: impl std::fmt::Display) -> AdoptError {
    AdoptError::Kernel {
        netns: pod.netns_path.display().to_string(),
        reason: e.to_string(),
    }
}

/// The adopter, its maps the node's pinned ones in `maps_dir` (never new ones: a missing pin is
/// an error, not a map of its own that nothing else would read).
fn load(maps_dir: &Path) -> Result<Ebpf, String> {
    if OBJECT.is_empty() {
        return Err("this binary was built without kernel programs".into());
    }
    let listeners = maps_dir.join(MapId::InboundListeners.name());
    let states = maps_dir.join(MapId::SocketStates.name());
    for pin in [&listeners, &states] {
        if !pin.exists() {
            return Err(format!("the node's map {} is not pinned", pin.display()));
        }
    }
    let mut ebpf = EbpfLoader::new()
        .map_pin_path(MapId::InboundListeners.name(), listeners.as_path())
        .map_pin_path(MapId::SocketStates.name(), states.as_path())
        .load(OBJECT)
        .map_err(|e| format!("loading the listener adopter: {e}"))?;
    let program: &mut SchedClassifier = ebpf
        .program_mut(PROGRAM)
        .ok_or("the adopter object has no program")?
        .try_into()
        .map_err(|e| format!("the listener adopter: {e}"))?;
    program
        .load()
        .map_err(|e| format!("the kernel refused the listener adopter: {e}"))?;
    Ok(ebpf)
}

/// The adopter's program, loaded.
fn adopter(ebpf: &Ebpf) -> Result<&SchedClassifier, String> {
    ebpf.program(PROGRAM)
        .ok_or("the adopter object has no program")?
        .try_into()
        .map_err(|e| format!("the listener adopter: {e}"))
}

/// Meets the members of one group (on this thread, inside the pod's netns) and registers each;
/// how many it registered. A group that is gone (closed since `sock_diag` listed it) registers
/// nothing; one whose members are not all met keeps those that were (any one of a group serves).
fn adopt_group(
    program: &SchedClassifier,
    netns_cookie: u64,
    group: Group,
    members: usize,
) -> Result<usize, String> {
    let mut request = AdoptRequest {
        netns_cookie,
        addr: address_words(group.local.ip(), group.ipv6),
        family: u32::from(if group.ipv6 { AF_INET6 } else { AF_INET }),
        port: group.local.port(),
        action: group.action,
        ..AdoptRequest::default()
    };
    let mut met = BTreeSet::new();
    let mut registered = 0;
    for lookup in 0..members * LOOKUPS_PER_MEMBER {
        request.source_port = FIRST_SOURCE_PORT.wrapping_add(lookup as u16);
        let answer = run(program, &request)?;
        match answer.outcome {
            OUTCOME_NOT_FOUND => break,
            OUTCOME_REGISTERED => {
                registered += 1;
                met.insert(answer.socket);
            }
            OUTCOME_ALREADY => {
                met.insert(answer.socket);
            }
            // The kernel registered the listener itself meanwhile (it listened again).
            OUTCOME_MAP_REFUSED if answer.detail == libc::EEXIST as u32 => {}
            outcome => return Err(refusal(group, outcome, answer.detail)),
        }
        if met.len() >= members {
            break;
        }
    }
    if met.len() < members {
        tracing::warn!(listener = %group.local, members, met = met.len(), "not every listener of a SO_REUSEPORT group was met; those met serve the group");
    }
    Ok(registered)
}

fn refusal(group: Group, outcome: u32, detail: u32) -> String {
    let what = match outcome {
        OUTCOME_SLOTS_FULL => "every listener slot of the pod is taken".to_string(),
        OUTCOME_NO_STATE => "the kernel could not allocate its socket state".to_string(),
        OUTCOME_MAP_REFUSED => format!(
            "the listener map refused it: {}",
            std::io::Error::from_raw_os_error(detail as i32)
        ),
        other => format!("the adopter answered {other}"),
    };
    format!("registering the {} listener: {what}", group.local)
}

/// One run of the adopter with `request`; its answer.
fn run(program: &SchedClassifier, request: &AdoptRequest) -> Result<AdoptAnswer, String> {
    let mut packet = [0u8; PACKET_LEN];
    // SAFETY: `AdoptRequest` is repr(C) without implicit padding (its size assertion), so its
    // bytes are all initialised; they are copied into the packet at their offset.
    unsafe {
        std::ptr::copy_nonoverlapping(
            std::ptr::from_ref(request).cast::<u8>(),
            packet[REQUEST_OFFSET..].as_mut_ptr(),
            size_of::<AdoptRequest>(),
        );
    }
    let mut out = [0u8; PACKET_LEN];
    program
        .test_run(TestRunOptions {
            data_in: Some(&packet),
            data_out: Some(&mut out),
            ..TestRunOptions::default()
        })
        .map_err(|e| format!("running the listener adopter: {e}"))?;
    let bytes = &out[ANSWER_OFFSET..];
    let word = |at: usize| u32::from_ne_bytes(bytes[at..at + 4].try_into().expect("4 bytes"));
    Ok(AdoptAnswer {
        socket: u64::from_ne_bytes(bytes[..8].try_into().expect("8 bytes")),
        outcome: word(8),
        detail: word(12),
    })
}

/// The listener's address as the kernel's lookup takes it: network-order words, an IPv4 address
/// of an IPv6 socket (`sock_diag` shows it unmapped) in its v4-mapped form.
fn address_words(ip: IpAddr, ipv6: bool) -> [u32; 4] {
    let octets = match (ip, ipv6) {
        (IpAddr::V4(v4), false) => {
            let mut o = [0u8; 16];
            o[..4].copy_from_slice(&v4.octets());
            o
        }
        (IpAddr::V4(v4), true) => v4.to_ipv6_mapped().octets(),
        (IpAddr::V6(v6), _) => v6.octets(),
    };
    std::array::from_fn(|i| u32::from_ne_bytes(octets[i * 4..i * 4 + 4].try_into().expect("4")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_are_given_as_the_lookup_takes_them() {
        let v4 = address_words("10.1.2.3".parse().unwrap(), false);
        assert_eq!(v4[0].to_ne_bytes(), [10, 1, 2, 3]);
        assert_eq!(&v4[1..], &[0, 0, 0]);
        let mapped = address_words("10.1.2.3".parse().unwrap(), true);
        assert_eq!(mapped[2].to_ne_bytes(), [0, 0, 0xff, 0xff]);
        assert_eq!(mapped[3].to_ne_bytes(), [10, 1, 2, 3]);
        assert_eq!(address_words("::".parse().unwrap(), true), [0; 4]);
    }

    #[test]
    fn the_object_declares_the_kernel_crates_license() {
        assert_eq!(
            super::super::loader::declared_license(OBJECT),
            "Dual MIT/GPL"
        );
    }
}
