//! One platform's layer: the static binaries, the tools the agent runs and every library they
//! name, the directories and links a container expects.

use std::{
    collections::BTreeSet,
    path::{Path, PathBuf},
};

use anyhow::{bail, Context as _, Result};
use capture_oci::Layer;

use super::{arch::Arch, elf, sources::Source};

/// The programs the agent runs in its container (the iptables names below link to the first two).
const ELF_TOOLS: [&str; 5] = [
    "/usr/sbin/xtables-nft-multi",
    "/usr/sbin/xtables-legacy-multi",
    "/usr/sbin/nft",
    "/usr/bin/ip",
    "/usr/bin/nsenter",
];

/// The iptables names the agent runs or an operator may (Debian links each to its multi-call
/// binary); the unsuffixed ones point at the nft variant, as Debian's alternatives do by default.
pub const IPTABLES_NAMES: [&str; 6] = [
    "iptables",
    "iptables-save",
    "iptables-restore",
    "ip6tables",
    "ip6tables-save",
    "ip6tables-restore",
];

/// A file of the layer taken from a platform's source tree.
#[derive(Clone, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct TakenFile {
    /// Where it is in the image.
    pub in_image: String,
    /// Where it was read from on this machine.
    pub source: PathBuf,
}

/// `arch`'s layer, and the files it took from `source`.
pub fn layer(arch: Arch, source: &Source, binaries: &[PathBuf]) -> Result<(Layer, Vec<TakenFile>)> {
    let mut layer = Layer::new();
    for (link, target) in [
        ("/bin", "usr/bin"),
        ("/sbin", "usr/sbin"),
        ("/lib", "usr/lib"),
        ("/lib64", "usr/lib64"),
    ] {
        layer.symlink(link, target);
    }
    layer.dir("/tmp", 0o1777);
    // iptables-legacy takes its lock in /run; the agent's socket and records live in /run/capture
    // (a host mount in the manifest).
    layer.dir("/run", 0o755);
    layer.dir("/etc", 0o755);
    for bin in binaries {
        let name = bin.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        layer.file(
            &format!("/usr/local/bin/{name}"),
            std::fs::read(bin)?,
            0o755,
        );
    }
    let mut taken = Vec::new();
    for path in ELF_TOOLS {
        taken.push(take(arch, source, path)?);
    }
    for name in IPTABLES_NAMES {
        for variant in ["nft", "legacy"] {
            layer.symlink(
                &format!("/usr/sbin/{}", of_variant(name, variant)),
                &format!("xtables-{variant}-multi"),
            );
        }
        layer.symlink(&format!("/usr/sbin/{name}"), &of_variant(name, "nft"));
    }
    // Debian's iptables keeps its match and target extensions here, loaded with dlopen (so no
    // binary names them); the iptables and ip6tables ones, not ebtables' or arptables'.
    let xtables = format!("/usr/lib/{}/xtables", arch.triplet);
    let extensions: Vec<String> = source
        .list(&xtables)
        .into_iter()
        .filter(|f| {
            ["libxt_", "libipt_", "libip6t_"]
                .iter()
                .any(|p| f.starts_with(p))
        })
        .collect();
    if extensions.is_empty() {
        bail!(
            "no iptables extensions in {xtables} for {}: run cargo xtask setup",
            arch.oci
        );
    }
    for file in extensions {
        taken.push(take(arch, source, &format!("{xtables}/{file}"))?);
    }
    let libraries = libraries(arch, source, &taken)?;
    taken.extend(libraries);
    for file in &taken {
        copy(&mut layer, file)?;
    }
    taken.sort();
    Ok((layer, taken))
}

/// The file `source` ships at `path`, at its merged-/usr place in the image.
fn take(arch: Arch, source: &Source, path: &str) -> Result<TakenFile> {
    let found = source.locate(path).with_context(|| {
        format!(
            "{path} for the {} image is missing: run cargo xtask setup",
            arch.oci
        )
    })?;
    Ok(TakenFile {
        in_image: merged_usr(path),
        source: found,
    })
}

/// Every library `files` need, transitively, and the dynamic loader, each where the loader looks
/// for it; fails naming any that `source` lacks or that is another architecture's.
fn libraries(arch: Arch, source: &Source, files: &[TakenFile]) -> Result<Vec<TakenFile>> {
    let mut queue: Vec<TakenFile> = files.to_vec();
    let mut found: Vec<TakenFile> = Vec::new();
    let mut seen = BTreeSet::new();
    // The programs' loader, which also satisfies libc's DT_NEEDED on it by being loaded already:
    // one entry, at the path the programs name.
    let mut loaders = BTreeSet::new();
    for file in files {
        if let Some(loader) = read_linking(arch, file)?.interpreter {
            if let Some(name) = Path::new(&loader).file_name() {
                loaders.insert(name.to_string_lossy().into_owned());
            }
            if seen.insert(merged_usr(&loader)) {
                found.push(take(arch, source, &loader)?);
            }
        }
    }
    while let Some(file) = queue.pop() {
        for name in read_linking(arch, &file)?.needed {
            if loaders.contains(&name) {
                continue;
            }
            let path = library_path(arch, source, &name)?;
            if seen.insert(merged_usr(&path)) {
                let library = take(arch, source, &path)?;
                found.push(library.clone());
                queue.push(library);
            }
        }
    }
    Ok(found)
}

/// How `file` links, refused unless it is `arch`'s.
fn read_linking(arch: Arch, file: &TakenFile) -> Result<elf::Linking> {
    let data = std::fs::read(&file.source)
        .with_context(|| format!("reading {}", file.source.display()))?;
    let linking = elf::linking(&data)
        .with_context(|| format!("reading the ELF headers of {}", file.source.display()))?;
    if linking.machine != arch.elf_machine {
        bail!(
            "{} is not an {} binary (ELF machine {})",
            file.source.display(),
            arch.oci,
            linking.machine
        );
    }
    Ok(linking)
}

/// Where the loader finds library `name`: the architecture's multiarch directory, then /usr/lib.
fn library_path(arch: Arch, source: &Source, name: &str) -> Result<String> {
    [
        format!("/usr/lib/{}/{name}", arch.triplet),
        format!("/usr/lib/{name}"),
    ]
    .into_iter()
    .find(|path| source.locate(path).is_some())
    .with_context(|| format!("no {name} for {} among the image's packages", arch.oci))
}

/// `/usr/lib/x` for `/lib/x` (and the like for bin, sbin, lib64): the image's /lib is a link to
/// usr/lib, so each file has one entry, under /usr.
fn merged_usr(path: &str) -> String {
    if ["/lib/", "/lib64/", "/bin/", "/sbin/"]
        .iter()
        .any(|p| path.starts_with(p))
    {
        format!("/usr{path}")
    } else {
        path.to_string()
    }
}

/// Debian's name of an iptables program in one variant: `iptables-save` in `legacy` is
/// `iptables-legacy-save`.
pub fn of_variant(name: &str, variant: &str) -> String {
    match name.split_once('-') {
        Some((base, op)) => format!("{base}-{variant}-{op}"),
        None => format!("{name}-{variant}"),
    }
}

/// Copies a taken file (its content, through links, and its permissions) into the layer.
fn copy(layer: &mut Layer, file: &TakenFile) -> Result<()> {
    use std::os::unix::fs::PermissionsExt as _;
    let context = || {
        format!(
            "reading {} for the image: run cargo xtask setup",
            file.source.display()
        )
    };
    let data = std::fs::read(&file.source).with_context(context)?;
    let mode = std::fs::metadata(&file.source)
        .with_context(context)?
        .permissions()
        .mode()
        & 0o7777;
    layer.file(&file.in_image, data, mode);
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn files_under_the_root_links_go_under_usr() {
        assert_eq!(
            merged_usr("/lib/ld-linux-aarch64.so.1"),
            "/usr/lib/ld-linux-aarch64.so.1"
        );
        assert_eq!(
            merged_usr("/lib64/ld-linux-x86-64.so.2"),
            "/usr/lib64/ld-linux-x86-64.so.2"
        );
        assert_eq!(merged_usr("/bin/ip"), "/usr/bin/ip");
        assert_eq!(merged_usr("/usr/sbin/nft"), "/usr/sbin/nft");
        assert_eq!(merged_usr("/library"), "/library");
    }

    #[test]
    fn iptables_names_by_variant() {
        assert_eq!(
            of_variant("iptables-save", "legacy"),
            "iptables-legacy-save"
        );
        assert_eq!(of_variant("ip6tables", "nft"), "ip6tables-nft");
    }

    #[test]
    fn this_machines_layer_holds_what_ldd_says_its_tools_load() {
        let arch = Arch::host();
        let (_, taken) = layer(arch, &Source::Host, &[]).unwrap();
        let in_image: BTreeSet<&str> = taken.iter().map(|f| f.in_image.as_str()).collect();
        for tool in [
            "/usr/sbin/nft",
            "/usr/sbin/xtables-nft-multi",
            "/usr/bin/ip",
        ] {
            let host = Source::Host.locate(tool).unwrap();
            for library in capture_oci::shared_libraries(&host).unwrap() {
                let name = Path::new(&library).file_name().unwrap().to_string_lossy();
                assert!(
                    in_image.iter().any(|p| p.ends_with(&format!("/{name}"))),
                    "{tool} loads {library}, missing from {in_image:?}"
                );
            }
        }
    }
}
