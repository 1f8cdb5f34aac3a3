//! CNI claims: the agent's note on the node that capture may hold state for a container.
//!
//! The agent writes a claim before an ADD starts attaching and removes it once DEL or GC has
//! released the pod, or once a failed ADD has rolled back. capture-cni reads them to answer DEL
//! while the agent is down: a container without a claim (and without a pod record naming it,
//! for pods captured before claims existed) was never captured and can be torn down at once;
//! one with a claim waits for the agent, which alone can release its kernel state.

use std::{fs, io, path::PathBuf};

use crate::{
    fsutil::{container_file_name, write_atomic},
    paths::Paths,
    record,
};

/// The claim file of a container.
fn claim_path(paths: &Paths, container_id: &str) -> PathBuf {
    paths.claims_dir().join(container_file_name(container_id))
}

/// Records that capture may hold state for the container from now on.
pub fn claim(paths: &Paths, container_id: &str) -> io::Result<()> {
    fs::create_dir_all(paths.claims_dir())?;
    write_atomic(
        &claim_path(paths, container_id),
        container_id.as_bytes(),
        None,
    )
}

/// Withdraws the claim (nothing of capture is left for the container).
pub fn release(paths: &Paths, container_id: &str) -> io::Result<()> {
    match fs::remove_file(claim_path(paths, container_id)) {
        Err(e) if e.kind() != io::ErrorKind::NotFound => Err(e),
        _ => Ok(()),
    }
}

/// Whether capture may hold state for the container: it has a claim, or a pod record names it.
pub fn is_claimed(paths: &Paths, container_id: &str) -> io::Result<bool> {
    if claim_path(paths, container_id).exists() {
        return Ok(true);
    }
    let records = record::load_all(paths).map_err(io::Error::other)?;
    Ok(records.iter().any(|r| {
        r.pod
            .as_ref()
            .is_some_and(|p| p.container_id == container_id)
    }))
}

/// The container ids that hold a claim.
pub fn claimed(paths: &Paths) -> io::Result<Vec<String>> {
    let dir = match fs::read_dir(paths.claims_dir()) {
        Ok(dir) => dir,
        Err(e) if e.kind() == io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let mut ids = Vec::new();
    for entry in dir {
        let path = entry?.path();
        // Temporaries of write_atomic start with a dot; the claim's content is its id.
        if path
            .file_name()
            .is_some_and(|n| !n.to_string_lossy().starts_with('.'))
        {
            ids.push(fs::read_to_string(&path)?);
        }
    }
    Ok(ids)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn scratch(name: &str) -> Paths {
        let dir =
            std::env::temp_dir().join(format!("capture-claims-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&dir);
        Paths::new(dir.join("bpffs"), dir.join("state"))
    }

    #[test]
    fn a_claim_lasts_until_released_and_odd_ids_stay_in_the_directory() {
        let paths = scratch("cycle");
        let id = "0123abcd_ef.45-x";
        assert!(!is_claimed(&paths, id).unwrap());
        claim(&paths, id).unwrap();
        claim(&paths, "../../etc/passwd").unwrap();
        assert!(is_claimed(&paths, id).unwrap());
        assert!(is_claimed(&paths, "../../etc/passwd").unwrap());
        let mut all = claimed(&paths).unwrap();
        all.sort();
        assert_eq!(all, ["../../etc/passwd", id]);
        assert!(claim_path(&paths, "../../etc/passwd").starts_with(paths.claims_dir()));
        release(&paths, id).unwrap();
        release(&paths, id).unwrap();
        assert!(!is_claimed(&paths, id).unwrap());
        fs::remove_dir_all(paths.state_dir.parent().unwrap()).unwrap();
    }
}
