//! The Debian archive this machine installs from, read from its own apt sources, so that the
//! kernel packages of the VM matrix and the clean root of the setup check come from the same place
//! as everything else the machine installs (and no archive address is written into the code).

use std::{fs, path::Path};

use anyhow::{Context as _, Result};

/// Overrides what the machine's sources say.
const MIRROR_ENV: &str = "CAPTURE_DEBIAN_MIRROR";

/// The archive URI of the first `deb` source that serves `suite` (a codename such as
/// `bookworm`), in the order apt reads its sources; `CAPTURE_DEBIAN_MIRROR` wins when set.
pub fn debian_mirror(suite: &str) -> Result<String> {
    if let Ok(mirror) = std::env::var(MIRROR_ENV) {
        if !mirror.is_empty() {
            return Ok(mirror);
        }
    }
    let mut files = vec![Path::new("/etc/apt/sources.list").to_path_buf()];
    if let Ok(dir) = fs::read_dir("/etc/apt/sources.list.d") {
        let mut parts: Vec<_> = dir.filter_map(Result::ok).map(|e| e.path()).collect();
        parts.sort();
        files.extend(parts);
    }
    files
        .iter()
        .find_map(|path| {
            let text = fs::read_to_string(path).ok()?;
            match path.extension()?.to_str()? {
                "list" => one_line_mirror(&text, suite),
                "sources" => deb822_mirror(&text, suite),
                // apt ignores every other name (a disabled source among them).
                _ => None,
            }
        })
        .with_context(|| {
            format!(
                "no Debian archive for {suite} in /etc/apt/sources.list or sources.list.d: add \
                 one, or set {MIRROR_ENV} to an archive's URI"
            )
        })
}

/// `deb [options] URI SUITE COMPONENT...` lines.
fn one_line_mirror(text: &str, suite: &str) -> Option<String> {
    text.lines().find_map(|line| {
        let line = line.split('#').next().unwrap_or_default();
        let mut words = line.split_whitespace();
        if words.next() != Some("deb") {
            return None;
        }
        let mut words = words.skip_while(|w| w.starts_with('['));
        // An option list may span several words: `[ arch=amd64 signed-by=... ]`.
        let uri = words.find(|w| !w.ends_with(']') && !w.contains('='))?;
        (words.next() == Some(suite)).then(|| uri.to_string())
    })
}

/// deb822 stanzas: `Types: deb`, `URIs: ...`, `Suites: ...`, separated by blank lines.
fn deb822_mirror(text: &str, suite: &str) -> Option<String> {
    text.split("\n\n").find_map(|stanza| {
        let field = |name: &str| {
            stanza
                .lines()
                .filter(|l| !l.starts_with('#'))
                .find_map(|l| l.strip_prefix(name)?.strip_prefix(':'))
                .map(str::trim)
        };
        let enabled = field("Enabled").is_none_or(|v| v != "no");
        let is_deb = field("Types")?.split_whitespace().any(|t| t == "deb");
        let serves = field("Suites")?.split_whitespace().any(|s| s == suite);
        (enabled && is_deb && serves)
            .then(|| field("URIs")?.split_whitespace().next().map(str::to_string))
            .flatten()
    })
}

/// This machine's Debian codename (`VERSION_CODENAME` in /etc/os-release).
pub fn codename() -> Result<String> {
    let text = fs::read_to_string("/etc/os-release").context("reading /etc/os-release")?;
    text.lines()
        .find_map(|l| l.strip_prefix("VERSION_CODENAME="))
        .map(|v| v.trim_matches('"').to_string())
        .filter(|v| !v.is_empty())
        .context("/etc/os-release names no VERSION_CODENAME: this check needs a Debian release")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_line_sources_give_the_uri_of_the_suite() {
        let text = "# deb http://old.invalid/debian bookworm main\n\
                    deb-src http://src.invalid/debian bookworm main\n\
                    deb http://sec.invalid/debian-security bookworm-security main\n\
                    deb [arch=amd64 signed-by=/k.gpg] http://mirror.invalid/debian bookworm main\n";
        assert_eq!(
            one_line_mirror(text, "bookworm").as_deref(),
            Some("http://mirror.invalid/debian")
        );
        let spaced = "deb [ arch=amd64 ] http://m.invalid/debian trixie main\n";
        assert_eq!(
            one_line_mirror(spaced, "trixie").as_deref(),
            Some("http://m.invalid/debian")
        );
        assert_eq!(one_line_mirror(text, "trixie"), None);
    }

    #[test]
    fn deb822_sources_give_the_uri_of_the_suite() {
        let text = "Types: deb\n# a comment\nURIs: http://sec.invalid/debian-security\n\
                    Suites: bookworm-security\nComponents: main\n\n\
                    Types: deb\nURIs: http://off.invalid/debian\nSuites: bookworm\nEnabled: no\n\n\
                    Types: deb deb-src\nURIs: http://mirror.invalid/debian\n\
                    Suites: bookworm bookworm-updates\nComponents: main\n";
        assert_eq!(
            deb822_mirror(text, "bookworm").as_deref(),
            Some("http://mirror.invalid/debian")
        );
        assert_eq!(deb822_mirror(text, "bullseye"), None);
    }
}
