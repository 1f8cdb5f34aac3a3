//! File-system helpers any module may use; this module depends on nothing of capture's.

use std::{fs, io, os::unix::fs::PermissionsExt as _, path::Path};

/// Writes a file so that readers see the old or the new content, never a torn one: the data
/// goes to a hidden temporary beside it (a name no CNI runtime takes for a network
/// configuration, and no `*.json` scan picks up), which is then renamed over the file.
pub fn write_atomic(path: &Path, data: &[u8], mode: Option<u32>) -> io::Result<()> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let tmp = dir.join(format!(
        ".{}.capture-tmp",
        path.file_name().unwrap_or_default().to_string_lossy()
    ));
    fs::write(&tmp, data)?;
    if let Some(mode) = mode {
        fs::set_permissions(&tmp, fs::Permissions::from_mode(mode))?;
    }
    fs::rename(&tmp, path)
}

/// A file name for a CNI container id. Container ids are letters, digits, `_`, `.` and `-`; any
/// other id is hex-encoded, so that no id can name a path outside the directory.
#[must_use]
pub fn container_file_name(container_id: &str) -> String {
    let plain = !container_id.is_empty()
        && !container_id.starts_with('.')
        && container_id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'));
    if plain {
        container_id.to_string()
    } else {
        let hex: String = container_id.bytes().map(|b| format!("{b:02x}")).collect();
        format!("x-{hex}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_the_file_and_leaves_no_temporary() {
        let dir = std::env::temp_dir().join(format!("capture-fsutil-{}", std::process::id()));
        fs::create_dir_all(&dir).unwrap();
        let path = dir.join("a.json");
        fs::write(&path, b"old").unwrap();
        write_atomic(&path, b"new", Some(0o640)).unwrap();
        let content = fs::read(&path).unwrap();
        let mode = fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        let names: Vec<_> = fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().file_name())
            .collect();
        fs::remove_dir_all(&dir).unwrap();
        assert_eq!(content, b"new");
        assert_eq!(mode, 0o640);
        assert_eq!(names, ["a.json"]);
    }
}
