//! One writer at a time per node: attach, detach and first loads take an exclusive flock.

use std::{fs::File, io, path::Path};

use nix::fcntl::{Flock, FlockArg};

pub struct NodeLock {
    _lock: Flock<File>,
}

impl NodeLock {
    pub fn acquire(path: &Path) -> io::Result<Self> {
        let file = File::options()
            .create(true)
            .truncate(false)
            .write(true)
            .open(path)?;
        let lock =
            Flock::lock(file, FlockArg::LockExclusive).map_err(|(_, e)| io::Error::from(e))?;
        Ok(Self { _lock: lock })
    }
}
