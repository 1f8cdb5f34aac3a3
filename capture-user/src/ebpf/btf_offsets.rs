//! Where the kernel keeps a socket's owner: the byte offsets of `sock.sk_socket`, `socket.file`,
//! `file.f_cred` and `cred.fsuid`/`fsgid`, read from the running kernel's BTF. The programs walk
//! that chain to judge a TCP socket by its creator, as iptables' owner match does, without
//! recording anything per socket. Layouts differ between kernels and configurations, so the
//! offsets are found here and written into the object's `.rodata` before it loads.
//!
//! Only what this needs of the BTF format is read: the type section's records, to find a struct
//! by name and a member's offset in it.

use std::path::Path;

/// The kernel's BTF, where every kernel with BTF publishes it.
const VMLINUX_BTF: &str = "/sys/kernel/btf/vmlinux";

const BTF_MAGIC: u16 = 0xeb9f;
const KIND_STRUCT: u32 = 4;

/// The offsets the owner walk needs, in bytes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct OwnerOffsets {
    pub sock_sk_socket: u32,
    pub socket_file: u32,
    pub file_f_cred: u32,
    pub cred_fsuid: u32,
    pub cred_fsgid: u32,
}

impl OwnerOffsets {
    /// From the running kernel, if it publishes BTF with every member the walk needs.
    pub fn of_running_kernel() -> Result<Self, String> {
        Self::from_file(Path::new(VMLINUX_BTF))
    }

    pub fn from_file(path: &Path) -> Result<Self, String> {
        let data = std::fs::read(path).map_err(|e| format!("reading {}: {e}", path.display()))?;
        Self::from_btf(&data).map_err(|e| format!("{}: {e}", path.display()))
    }

    /// The offsets, from raw BTF. A `tcp_sock` must begin with its `sock` (the programs hold a
    /// `tcp_sock` pointer and read the `sock`'s member through it).
    pub fn from_btf(data: &[u8]) -> Result<Self, String> {
        let btf = Btf::parse(data)?;
        // One walk of the type section for all of them: vmlinux has over 100,000 types, and
        // every attach reads them.
        let structs = btf.structs(&[
            "tcp_sock",
            "inet_connection_sock",
            "inet_sock",
            "sock",
            "socket",
            "file",
            "cred",
        ])?;
        let offset = |outer: &str, member: &str| -> Result<u32, String> {
            let found = structs
                .iter()
                .find(|(name, _)| *name == outer)
                .and_then(|(_, s)| s.as_ref())
                .ok_or_else(|| format!("no struct {outer}"))?;
            btf.member_offset(found, outer, member)
        };
        for (outer, first) in [
            ("tcp_sock", "inet_conn"),
            ("inet_connection_sock", "icsk_inet"),
            ("inet_sock", "sk"),
        ] {
            if offset(outer, first)? != 0 {
                return Err(format!("struct {outer} does not begin with {first}"));
            }
        }
        Ok(Self {
            sock_sk_socket: offset("sock", "sk_socket")?,
            socket_file: offset("socket", "file")?,
            file_f_cred: offset("file", "f_cred")?,
            cred_fsuid: offset("cred", "fsuid")?,
            cred_fsgid: offset("cred", "fsgid")?,
        })
    }
}

/// The parts of a BTF blob the offsets come from.
struct Btf<'a> {
    types: &'a [u8],
    strings: &'a [u8],
}

fn u16_at(data: &[u8], at: usize) -> Result<u16, String> {
    data.get(at..at + 2)
        .map(|b| u16::from_ne_bytes([b[0], b[1]]))
        .ok_or_else(|| format!("BTF ends at byte {}", data.len()))
}

fn u32_at(data: &[u8], at: usize) -> Result<u32, String> {
    data.get(at..at + 4)
        .map(|b| u32::from_ne_bytes([b[0], b[1], b[2], b[3]]))
        .ok_or_else(|| format!("BTF ends at byte {}", data.len()))
}

/// Bytes that follow a type's 12-byte record, by kind (the kernel's `btf_type` layout).
fn trailing_bytes(kind: u32, vlen: usize) -> Result<usize, String> {
    Ok(match kind {
        // int, var, decl_tag: one 4-byte word
        1 | 14 | 17 => 4,
        // ptr, fwd, typedef, volatile, const, restrict, func, float, type_tag
        2 | 7..=12 | 16 | 18 => 0,
        // array
        3 => 12,
        // struct, union, datasec, enum64: 12 bytes per member
        4 | 5 | 15 | 19 => 12 * vlen,
        // enum, func_proto: 8 bytes per entry
        6 | 13 => 8 * vlen,
        other => return Err(format!("unknown BTF kind {other}")),
    })
}

impl<'a> Btf<'a> {
    fn parse(data: &'a [u8]) -> Result<Self, String> {
        if u16_at(data, 0)? != BTF_MAGIC {
            return Err("not BTF in this byte order".to_string());
        }
        let header_len = u32_at(data, 4)? as usize;
        let section = |off_at: usize| -> Result<&'a [u8], String> {
            let start = header_len + u32_at(data, off_at)? as usize;
            let len = u32_at(data, off_at + 4)? as usize;
            data.get(start..start + len)
                .ok_or_else(|| "a BTF section runs past the end".to_string())
        };
        Ok(Self {
            types: section(8)?,
            strings: section(16)?,
        })
    }

    fn name(&self, offset: u32) -> &'a [u8] {
        let rest = self.strings.get(offset as usize..).unwrap_or_default();
        &rest[..rest.iter().position(|&b| b == 0).unwrap_or(rest.len())]
    }

    /// Each of `names` with the first struct of that name that has members, if there is one,
    /// from one walk of the type section.
    fn structs<'n>(&self, names: &[&'n str]) -> Result<Vec<(&'n str, Option<Struct>)>, String> {
        let mut found: Vec<(&str, Option<Struct>)> = names.iter().map(|n| (*n, None)).collect();
        let mut missing = names.len();
        let mut at = 0;
        while at < self.types.len() && missing > 0 {
            let name = u32_at(self.types, at)?;
            let info = u32_at(self.types, at + 4)?;
            let kind = (info >> 24) & 0x1f;
            let vlen = (info & 0xffff) as usize;
            let members = at + 12;
            at = members + trailing_bytes(kind, vlen)?;
            if kind != KIND_STRUCT || vlen == 0 {
                continue;
            }
            let name = self.name(name);
            if let Some((_, slot @ None)) = found.iter_mut().find(|(n, _)| n.as_bytes() == name) {
                *slot = Some(Struct {
                    members,
                    vlen,
                    bitfields: info >> 31 == 1,
                });
                missing -= 1;
            }
        }
        Ok(found)
    }

    /// The byte offset of `member` in `found`, the struct named `outer`.
    fn member_offset(&self, found: &Struct, outer: &str, member: &str) -> Result<u32, String> {
        for i in 0..found.vlen {
            let m = found.members + 12 * i;
            if self.name(u32_at(self.types, m)?) != member.as_bytes() {
                continue;
            }
            let raw = u32_at(self.types, m + 8)?;
            // With the kind flag set, the top byte is a bitfield's size and the rest its
            // offset in bits.
            let bits = if found.bitfields {
                raw & 0x00ff_ffff
            } else {
                raw
            };
            if bits % 8 != 0 {
                return Err(format!("{outer}.{member} is a bitfield"));
            }
            return Ok(bits / 8);
        }
        Err(format!("struct {outer} has no member {member}"))
    }
}

/// A struct's record in the type section: where its members begin, how many there are, and
/// whether their offsets carry bitfield sizes (the kind flag).
struct Struct {
    members: usize,
    vlen: usize,
    bitfields: bool,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_running_kernels_owner_offsets() {
        // Every kernel capture supports publishes BTF; the values depend on its configuration,
        // so only their shape is checked: inside each struct, and fsgid right after fsuid.
        let offsets = OwnerOffsets::of_running_kernel().expect("the kernel publishes BTF");
        assert!(offsets.sock_sk_socket > 0 && offsets.sock_sk_socket < 4096);
        assert!(offsets.file_f_cred > 0 && offsets.file_f_cred < 1024);
        assert!(offsets.socket_file > 0 && offsets.socket_file < 256);
        assert_eq!(offsets.cred_fsgid, offsets.cred_fsuid + 4);
    }

    #[test]
    fn refuses_what_is_not_btf() {
        assert!(OwnerOffsets::from_btf(b"not btf at all, just bytes").is_err());
        assert!(OwnerOffsets::from_btf(&[]).is_err());
    }
}
