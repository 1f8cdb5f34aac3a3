//! Writing, removing and checking a pod's tables with `nft -j -f FILE`, started inside the pod's
//! netns (`netns::output_in`): all of a pod's tables go in one JSON document, which nft applies
//! as one netlink transaction, so a pod has all of its rules or none.

use std::{
    borrow::Cow,
    path::{Path, PathBuf},
    process::Command,
};

use nftables::{
    schema::{Chain, NfCmd, NfListObject, NfObject, Nftables, Rule, Table as NftTable},
    types::{NfChainPolicy, NfFamily},
};
use serde_json::Value;

use super::rules::{tables, Table, TABLES};
use crate::{
    config::CaptureConfig,
    netns::{output_in, Netns},
    nf_tables,
};

#[derive(Debug, thiserror::Error)]
pub enum NftablesError {
    #[error("running nft in netns {netns}: {reason}; install nftables (Debian: apt-get install nftables)")]
    Spawn { netns: PathBuf, reason: String },
    #[error("nft in netns {netns} refused the rules: {stderr}")]
    Rejected { netns: PathBuf, stderr: String },
    #[error("nft in netns {netns} printed what capture cannot read: {reason}")]
    Unreadable { netns: PathBuf, reason: String },
}

/// Runs `nft ARGS` in the netns with `input` on stdin; returns its stdout.
fn nft(netns: &Path, args: &[&str], input: &str) -> Result<String, NftablesError> {
    let out = output_in(netns, Command::new("nft").args(args), input.as_bytes()).map_err(|e| {
        NftablesError::Spawn {
            netns: netns.into(),
            reason: e.to_string(),
        }
    })?;
    if !out.status.success() {
        return Err(NftablesError::Rejected {
            netns: netns.into(),
            stderr: String::from_utf8_lossy(&out.stderr)
                .trim()
                .replace('\n', "; "),
        });
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// The JSON document that creates `tables`: each table, its chains (base chains with their hooks),
/// then its rules in order.
#[must_use]
pub fn creation(tables: &[Table]) -> Nftables<'static> {
    let mut objects = Vec::new();
    for t in tables {
        let table = Cow::Borrowed(t.name);
        // `create`, not `add`: a table of this name already there fails the whole batch rather
        // than taking capture's chains into it.
        objects.push(NfObject::CmdObject(NfCmd::Create(NfListObject::Table(
            NftTable {
                family: NfFamily::INet,
                name: table.clone(),
                handle: None,
            },
        ))));
        for c in &t.chains {
            objects.push(add(NfListObject::Chain(Chain {
                family: NfFamily::INet,
                table: table.clone(),
                name: Cow::Borrowed(c.name),
                _type: c.hook.map(|h| h.kind),
                hook: c.hook.map(|h| h.hook),
                prio: c.hook.map(|h| h.priority),
                policy: c.hook.map(|_| NfChainPolicy::Accept),
                ..Chain::default()
            })));
        }
        for c in &t.chains {
            for r in &c.rules {
                objects.push(add(NfListObject::Rule(Rule {
                    family: NfFamily::INet,
                    table: table.clone(),
                    chain: Cow::Borrowed(c.name),
                    expr: Cow::Owned(r.stmts.clone()),
                    comment: r.comment.map(Cow::Borrowed),
                    ..Rule::default()
                })));
            }
        }
    }
    Nftables {
        objects: Cow::Owned(objects),
    }
}

fn add(object: NfListObject<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Add(object))
}

/// Applies a document as one transaction. nft reads it from a file, not from `-f -`: nft opens
/// `/dev/stdin` by name, which a pod's user namespace may not (the pipe belongs to the node's
/// root); a world-readable file it can.
fn apply_document(netns: &Path, doc: &Nftables<'_>) -> Result<(), NftablesError> {
    let json = serde_json::to_string(doc).expect("the nftables schema serializes");
    let file = DocumentFile::write(&json).map_err(|e| NftablesError::Spawn {
        netns: netns.into(),
        reason: format!("writing the rules for nft: {e}"),
    })?;
    let path = file.0.to_string_lossy().into_owned();
    nft(netns, &["-j", "-f", &path], "").map(drop)
}

/// A document for nft, removed when dropped.
struct DocumentFile(PathBuf);

impl DocumentFile {
    fn write(json: &str) -> std::io::Result<Self> {
        use std::{io::Write as _, os::unix::fs::OpenOptionsExt as _, sync::atomic};
        static NEXT: atomic::AtomicU64 = atomic::AtomicU64::new(0);
        let n = NEXT.fetch_add(1, atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("capture-nft-{}-{n}.json", std::process::id()));
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .mode(0o644)
            .open(&path)?;
        let file = Self(path);
        // Readable by the pod's user namespace whatever the umask.
        f.set_permissions(std::os::unix::fs::PermissionsExt::from_mode(0o644))?;
        f.write_all(json.as_bytes())?;
        Ok(file)
    }
}

impl Drop for DocumentFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The `inet` tables of capture's names present in the netns.
pub fn present(netns: &Path) -> Result<Vec<String>, NftablesError> {
    let unreadable = |reason: String| NftablesError::Unreadable {
        netns: netns.into(),
        reason,
    };
    let ns = Netns::open(netns).map_err(|e| unreadable(e.to_string()))?;
    Ok(ours(
        nf_tables::tables(&ns).map_err(|e| unreadable(e.to_string()))?,
    ))
}

/// The names of the `inet` tables among `tables` that are capture's (and Istio's) own.
pub fn ours(tables: Vec<nf_tables::Table>) -> Vec<String> {
    tables
        .into_iter()
        .filter(|t| t.family == "inet" && TABLES.contains(&t.name.as_str()))
        .map(|t| t.name)
        .collect()
}

fn list(netns: &Path, args: &[&str]) -> Result<Value, NftablesError> {
    let out = nft(netns, args, "")?;
    serde_json::from_str(&out).map_err(|e| NftablesError::Unreadable {
        netns: netns.into(),
        reason: e.to_string(),
    })
}

/// The objects of one kind (`table`, `chain`, `rule`) in an `nft -j list` document.
fn objects<'v>(listing: &'v Value, kind: &'v str) -> impl Iterator<Item = &'v Value> + 'v {
    listing
        .get("nftables")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .filter_map(move |o| o.get(kind))
}

/// Writes the pod's tables in one transaction. A table of the same name already in the netns
/// (another writer's, which `istio_rules` looked at before) fails it whole: merging rules into
/// it would capture twice.
pub fn apply(netns: &Path, cfg: &CaptureConfig) -> Result<(), NftablesError> {
    apply_document(netns, &creation(&tables(cfg)))
}

/// Deletes capture's tables from the netns, in one transaction; nothing to delete is success.
pub fn remove(netns: &Path) -> Result<(), NftablesError> {
    let found = present(netns)?;
    if found.is_empty() {
        return Ok(());
    }
    let deletions = found
        .into_iter()
        .map(|name| {
            NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(NftTable {
                family: NfFamily::INet,
                name: Cow::Owned(name),
                handle: None,
            })))
        })
        .collect::<Vec<_>>();
    apply_document(
        netns,
        &Nftables {
            objects: Cow::Owned(deletions),
        },
    )
}

/// What is missing from the netns (empty when the rules are in force): each table, chain, and
/// chain whose rules are fewer or more than capture wrote.
#[must_use]
pub fn missing(netns: &Path, cfg: &CaptureConfig) -> Vec<String> {
    let mut missing = Vec::new();
    for t in tables(cfg) {
        let Ok(listing) = list(netns, &["-j", "list", "table", "inet", t.name]) else {
            missing.push(format!("table inet {}", t.name));
            continue;
        };
        for c in &t.chains {
            if !objects(&listing, "chain").any(|o| o.get("name") == Some(&c.name.into())) {
                missing.push(format!("chain {} in table inet {}", c.name, t.name));
                continue;
            }
            let rules = objects(&listing, "rule")
                .filter(|o| o.get("chain") == Some(&c.name.into()))
                .count();
            if rules != c.rules.len() {
                missing.push(format!(
                    "chain {} in table inet {} holds {rules} rules, capture wrote {}",
                    c.name,
                    t.name,
                    c.rules.len()
                ));
            }
        }
    }
    missing
}
