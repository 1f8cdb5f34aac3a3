//! A file the agent reads again on demand and whose last usable content stays in force: the
//! mesh configurations and the annotation policy, both ConfigMaps that an operator may break
//! while pods keep starting. A content that cannot be used is kept as the file's problem, and
//! the last good one stays in use; with none before it, the file has nothing in use, which its
//! owner turns into refusals or unreadiness.

use std::path::{Path, PathBuf};

pub struct LastGood<T> {
    path: PathBuf,
    /// The bytes last read (or why they could not be), to tell a change.
    seen: Option<Result<Vec<u8>, String>>,
    in_use: Option<T>,
    problem: Option<String>,
}

/// What a refresh found.
#[derive(Debug, PartialEq, Eq)]
pub enum Refreshed {
    /// The same bytes (or the same error) as last time: nothing parsed.
    Unchanged,
    /// A new content, now in use.
    InUse,
    /// A new content that cannot be used: the last good one (if any) stays.
    Unusable,
}

impl<T> LastGood<T> {
    #[must_use]
    pub fn new(path: PathBuf) -> Self {
        Self {
            path,
            seen: None,
            in_use: None,
            problem: None,
        }
    }

    #[must_use]
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Reads the file again and, where its bytes changed, parses them with `parse`.
    pub fn refresh(&mut self, parse: impl FnOnce(&[u8]) -> Result<T, String>) -> Refreshed {
        let read = std::fs::read(&self.path).map_err(|e| e.to_string());
        if self.seen.as_ref() == Some(&read) {
            return Refreshed::Unchanged;
        }
        self.seen = Some(read.clone());
        match read
            .map_err(|e| format!("cannot read it: {e}"))
            .and_then(|data| parse(&data))
        {
            Ok(value) => {
                self.in_use = Some(value);
                self.problem = None;
                Refreshed::InUse
            }
            Err(problem) => {
                self.problem = Some(problem);
                Refreshed::Unusable
            }
        }
    }

    /// The content in use: the last that could be used.
    #[must_use]
    pub fn in_use(&self) -> Option<&T> {
        self.in_use.as_ref()
    }

    /// Why the last content read cannot be used, while it is the last read.
    #[must_use]
    pub fn problem(&self) -> Option<&str> {
        self.problem.as_deref()
    }
}

/// A file's bytes as UTF-8 text, for parsers of text formats.
///
/// # Errors
/// The bytes are not UTF-8.
pub fn text(data: &[u8]) -> Result<&str, String> {
    std::str::from_utf8(data).map_err(|e| format!("not UTF-8: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_bad_content_keeps_the_last_good_one_and_an_unchanged_one_is_not_parsed_again() {
        let dir = std::env::temp_dir().join(format!("capture-last-good-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("value");
        let number = |d: &[u8]| text(d)?.trim().parse::<u32>().map_err(|e| e.to_string());
        let mut file = LastGood::new(path.clone());
        assert_eq!(file.refresh(number), Refreshed::Unusable);
        assert!(file.problem().unwrap().starts_with("cannot read it"));
        assert_eq!(file.in_use(), None);
        std::fs::write(&path, "7").unwrap();
        assert_eq!(file.refresh(number), Refreshed::InUse);
        assert_eq!(
            file.refresh(|_| panic!("parsed again")),
            Refreshed::Unchanged
        );
        std::fs::write(&path, "seven").unwrap();
        assert_eq!(file.refresh(number), Refreshed::Unusable);
        assert_eq!(file.in_use(), Some(&7), "the last good one");
        assert!(file.problem().is_some());
        std::fs::write(&path, "8").unwrap();
        assert_eq!(file.refresh(number), Refreshed::InUse);
        assert_eq!((file.in_use(), file.problem()), (Some(&8), None));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
