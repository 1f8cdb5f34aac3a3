//! Where a platform's layer takes its tools and their libraries from: this machine's own files
//! for its own architecture, and another architecture's Debian packages (fetched and unpacked by
//! `cargo xtask setup`, not copied from this machine) for the others. Either way the files, and
//! the package each comes from, are the same Debian release's.

use std::{
    collections::BTreeMap,
    fs,
    path::{Path, PathBuf},
    process::Command,
};

use anyhow::{bail, Context as _, Result};
use serde::{Deserialize, Serialize};

use super::arch::Arch;
use crate::{output, run, setup::private_apt::PrivateApt};

/// What a package root is for: the name of its directory and the packages it is made of (apt
/// adds what they depend on, but not Debian's essential packages, which nothing declares).
pub struct PackageSet {
    pub name: &'static str,
    pub wanted: &'static [&'static str],
}

/// The packages whose programs the image runs.
pub const IMAGE_PACKAGES: PackageSet = PackageSet {
    name: "image",
    wanted: &["iptables", "nftables", "iproute2", "util-linux"],
};

/// Written last into a package root's directory: what it holds, once complete.
const INDEX: &str = "index.json";

/// A Debian package a layer's files come from.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct DebPackage {
    pub name: String,
    pub version: String,
    pub architecture: String,
    /// The source package it is built from.
    pub source: String,
    /// Its copyright file, which names its licences.
    pub copyright: PathBuf,
}

/// A tree of one architecture's files: the layer's files are read from it.
pub enum Source {
    /// This machine's root; dpkg says which package holds a file.
    Host,
    Packages(PackageRoot),
}

impl Source {
    /// Where `arch`'s files come from on this machine: itself for its own architecture, else the
    /// package root setup prepared.
    pub fn of(arch: Arch) -> Result<Self> {
        if arch.is_host() {
            return Ok(Self::Host);
        }
        let dir = PackageRoot::dir(arch, &IMAGE_PACKAGES);
        PackageRoot::cached(&dir)?
            .map(Self::Packages)
            .with_context(|| {
                format!(
                    "{} holds no Debian {} packages for the image: run cargo xtask setup",
                    dir.display(),
                    arch.debian
                )
            })
    }

    /// The file this tree ships at `path`, or at the other side of the merged-/usr link (Debian
    /// 12's packages still ship /lib and /bin; the image's /lib links to /usr/lib).
    pub fn locate(&self, path: &str) -> Option<PathBuf> {
        [path.to_string(), usr_alias(path)]
            .iter()
            .find_map(|candidate| match self {
                Self::Host => Some(PathBuf::from(candidate)).filter(|p| p.is_file()),
                Self::Packages(root) => root.resolve(candidate).filter(|p| p.is_file()),
            })
    }

    /// The names in directory `path` of this tree (empty when it has none).
    pub fn list(&self, path: &str) -> Vec<String> {
        let dir = match self {
            Self::Host => Some(PathBuf::from(path)),
            Self::Packages(root) => root.resolve(path),
        };
        let mut names: Vec<String> = dir
            .and_then(|d| fs::read_dir(d).ok())
            .into_iter()
            .flatten()
            .filter_map(Result::ok)
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    }

    /// The package of each located file of `files`.
    pub fn owners(&self, files: &[PathBuf]) -> Result<BTreeMap<PathBuf, DebPackage>> {
        match self {
            Self::Host => host_owners(files),
            Self::Packages(root) => files
                .iter()
                .map(|file| Ok((file.clone(), root.owner(file)?.clone())))
                .collect(),
        }
    }
}

/// `/lib/x` for `/usr/lib/x` and the reverse.
pub fn usr_alias(path: &str) -> String {
    path.strip_prefix("/usr")
        .map_or_else(|| format!("/usr{path}"), str::to_string)
}

/// Another architecture's packages unpacked into one tree, with which package holds each path.
pub struct PackageRoot {
    root: PathBuf,
    index: Index,
}

#[derive(Serialize, Deserialize)]
struct Index {
    packages: BTreeMap<String, DebPackage>,
    /// Every path a package ships (as in the package, `/lib/...` where it says so) → its name.
    paths: BTreeMap<String, String>,
}

impl PackageRoot {
    /// target/debian/<arch>/<set>: the private apt state, the unpacked root and its index.
    pub fn dir(arch: Arch, set: &PackageSet) -> PathBuf {
        crate::builds::target_dir()
            .join("debian")
            .join(arch.debian)
            .join(set.name)
    }

    /// The unpacked tree.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Fetches `arch`'s packages with a private apt (the machine's sources, resolved as for a
    /// machine of that architecture with nothing installed) and unpacks them, unless an earlier
    /// run did. Later runs reuse the tree without the network, so that two builds of the image
    /// read the same files.
    pub fn prepare(arch: Arch, set: &PackageSet) -> Result<Self> {
        let dir = Self::dir(arch, set);
        // Fetched again when the set has grown since.
        if let Some(root) = Self::cached(&dir)?
            .filter(|r| set.wanted.iter().all(|w| r.index.packages.contains_key(*w)))
        {
            return Ok(root);
        }
        println!(
            "setup: fetching Debian's {} packages of {} ({})",
            arch.debian,
            set.wanted.join(", "),
            set.name
        );
        let apt = PrivateApt::foreign(&dir.join("apt"), arch.debian)?;
        for old in fs::read_dir(apt.archives())?.filter_map(Result::ok) {
            if old.path().extension().is_some_and(|e| e == "deb") {
                fs::remove_file(old.path())?;
            }
        }
        run(apt.command("apt-get").args(["-q", "update"]))?;
        run(apt
            .command("apt-get")
            .args([
                "-q",
                "-y",
                "--no-install-recommends",
                "install",
                "--download-only",
            ])
            .args(set.wanted)
            .env("DEBIAN_FRONTEND", "noninteractive"))?;
        let root = dir.join("root");
        if root.exists() {
            fs::remove_dir_all(&root)?;
        }
        fs::create_dir_all(&root)?;
        let mut debs: Vec<PathBuf> = fs::read_dir(apt.archives())?
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|e| e == "deb"))
            .collect();
        debs.sort();
        let mut index = Index {
            packages: BTreeMap::new(),
            paths: BTreeMap::new(),
        };
        for deb in &debs {
            let package = unpack(deb, &root, &mut index.paths)?;
            index.packages.insert(package.name.clone(), package);
        }
        for wanted in set.wanted {
            if !index.packages.contains_key(*wanted) {
                bail!("apt downloaded no {wanted} for {}", arch.debian);
            }
        }
        fs::write(dir.join(INDEX), serde_json::to_vec_pretty(&index)?)?;
        Self::cached(&dir)?.context("the unpacked packages are incomplete")
    }

    /// The packages in `dir` if an earlier run finished unpacking them.
    fn cached(dir: &Path) -> Result<Option<Self>> {
        let Ok(text) = fs::read(dir.join(INDEX)) else {
            return Ok(None);
        };
        let index: Index = serde_json::from_slice(&text)
            .with_context(|| format!("reading {}", dir.join(INDEX).display()))?;
        Ok(Some(Self {
            root: dir.join("root"),
            index,
        }))
    }

    /// `path` inside the tree, its links followed inside the tree too (an absolute link target
    /// names the tree's root, not this machine's).
    fn resolve(&self, path: &str) -> Option<PathBuf> {
        let mut resolved = self.root.clone();
        let mut pending: Vec<String> = components(path);
        pending.reverse();
        let mut hops = 0;
        while let Some(part) = pending.pop() {
            match part.as_str() {
                "." => {}
                ".." => {
                    if resolved != self.root {
                        resolved.pop();
                    }
                }
                _ => {
                    let next = resolved.join(&part);
                    match fs::read_link(&next) {
                        Ok(target) => {
                            hops += 1;
                            if hops > 40 {
                                return None;
                            }
                            let target = target.to_string_lossy().into_owned();
                            if target.starts_with('/') {
                                resolved.clone_from(&self.root);
                            }
                            pending.extend(components(&target).into_iter().rev());
                        }
                        Err(_) => resolved = next,
                    }
                }
            }
        }
        resolved.exists().then_some(resolved)
    }

    /// The package that ships the resolved file `file`.
    fn owner(&self, file: &Path) -> Result<&DebPackage> {
        let inside = file
            .strip_prefix(&self.root)
            .map(|p| format!("/{}", p.display()))
            .with_context(|| format!("{} is not in {}", file.display(), self.root.display()))?;
        let name = self
            .index
            .paths
            .get(&inside)
            .or_else(|| self.index.paths.get(&usr_alias(&inside)))
            .with_context(|| {
                format!("which Debian package holds {inside}: none of those unpacked")
            })?;
        Ok(&self.index.packages[name])
    }
}

fn components(path: &str) -> Vec<String> {
    path.split('/')
        .filter(|c| !c.is_empty())
        .map(str::to_string)
        .collect()
}

/// Unpacks `deb` into `root`, notes the paths it ships, and says what it is.
fn unpack(deb: &Path, root: &Path, paths: &mut BTreeMap<String, String>) -> Result<DebPackage> {
    let fields = output(Command::new("dpkg-deb").arg("-f").arg(deb).args([
        "Package",
        "Version",
        "Architecture",
        "Source",
    ]))?;
    let field = |name: &str| {
        fields.lines().find_map(|l| {
            l.strip_prefix(name)?
                .strip_prefix(':')
                .map(|v| v.trim().to_string())
        })
    };
    let name = field("Package").with_context(|| format!("{} names no package", deb.display()))?;
    let version = field("Version").context("a package without a version")?;
    // `Source: util-linux (2.38.1-5)` when the versions differ; absent when the names agree.
    let source = field("Source")
        .and_then(|s| s.split_whitespace().next().map(str::to_string))
        .unwrap_or_else(|| name.clone());
    run(Command::new("dpkg-deb").arg("-x").arg(deb).arg(root))?;
    // `-rw-r--r-- root/root 1234 2024-01-01 00:00 ./usr/sbin/nft` (`… ./a -> b` for a link).
    for line in output(Command::new("dpkg-deb").arg("-c").arg(deb))?.lines() {
        if let Some(path) = line.split_whitespace().nth(5) {
            let path = path.trim_start_matches('.').trim_end_matches('/');
            if !path.is_empty() {
                paths.insert(path.to_string(), name.clone());
            }
        }
    }
    Ok(DebPackage {
        copyright: root.join(format!("usr/share/doc/{name}/copyright")),
        architecture: field("Architecture").unwrap_or_default(),
        name,
        version,
        source,
    })
}

/// The Debian package that holds each of this machine's `files`, asked of dpkg once for them all
/// (once per file took seconds).
fn host_owners(files: &[PathBuf]) -> Result<BTreeMap<PathBuf, DebPackage>> {
    let paths: Vec<String> = files.iter().map(|f| f.display().to_string()).collect();
    let names = super::owning_packages(paths.iter().map(String::as_str))?;
    // One query for every package; `${binary:Package}` is the name as `dpkg -S` gave it
    // (`libc6:amd64` for a multi-arch package), which keys the answer.
    let wanted: std::collections::BTreeSet<&String> = names.values().collect();
    let listed = output(
        Command::new("dpkg-query")
            .arg("-W")
            .arg("-f=${binary:Package}\t${Package}\t${Version}\t${Architecture}\t${source:Package}\n")
            .args(&wanted),
    )?;
    let mut facts: BTreeMap<String, DebPackage> = BTreeMap::new();
    for line in listed.lines() {
        let [key, package, version, architecture, source] =
            line.split('\t').collect::<Vec<_>>()[..]
        else {
            bail!("dpkg-query -W said {line:?}");
        };
        facts.insert(
            key.to_string(),
            DebPackage {
                name: package.to_string(),
                version: version.to_string(),
                architecture: architecture.to_string(),
                source: source.to_string(),
                copyright: PathBuf::from(format!("/usr/share/doc/{package}/copyright")),
            },
        );
    }
    files
        .iter()
        .zip(&paths)
        .map(|(file, path)| {
            let name = &names[path];
            let package = facts
                .get(name)
                .with_context(|| format!("dpkg-query -W did not list {name}"))?;
            Ok((file.clone(), package.clone()))
        })
        .collect()
}
