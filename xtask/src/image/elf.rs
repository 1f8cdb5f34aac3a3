//! What an ELF binary of any architecture asks of the dynamic loader, read from the file itself
//! (the host's ldd cannot run another architecture's binaries).

use anyhow::{Context as _, Result};
use object::{
    elf,
    read::elf::{FileHeader as _, ProgramHeader as _},
    Endianness,
};

/// How one ELF file links.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Linking {
    /// `e_machine`: whose instructions it holds.
    pub machine: u16,
    /// `PT_INTERP`: the dynamic loader, by its absolute path; none for a static binary or a
    /// library.
    pub interpreter: Option<String>,
    /// `DT_NEEDED`: the libraries it names, as the loader looks them up.
    pub needed: Vec<String>,
}

/// Reads the linking of a 64-bit ELF file.
pub fn linking(data: &[u8]) -> Result<Linking> {
    let header = elf::FileHeader64::<Endianness>::parse(data).context("not a 64-bit ELF file")?;
    let endian = header.endian()?;
    let mut interpreter = None;
    for segment in header.program_headers(endian, data)? {
        if let Some(path) = segment.interpreter(endian, data)? {
            interpreter = Some(String::from_utf8_lossy(path).into_owned());
        }
    }
    let table = header.sections(endian, data)?.dynamic_table(endian, data)?;
    let mut needed = Vec::new();
    for entry in &table {
        if entry.tag == elf::DT_NEEDED {
            needed.push(String::from_utf8_lossy(table.string(entry)?).into_owned());
        }
    }
    Ok(Linking {
        machine: header.e_machine(endian),
        interpreter,
        needed,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_loader_and_libraries_of_a_dynamic_binary_as_ldd_does() {
        let path = std::path::Path::new("/usr/bin/ls");
        let linking = linking(&std::fs::read(path).unwrap()).unwrap();
        assert_eq!(
            linking.machine,
            super::super::arch::Arch::host().elf_machine
        );
        let loader = linking.interpreter.clone().expect("ls has a loader");
        let ldd = capture_oci::shared_libraries(path).unwrap();
        assert!(ldd.contains(&loader), "{loader} in {ldd:?}");
        for library in &linking.needed {
            assert!(
                ldd.iter().any(|l| l.ends_with(&format!("/{library}"))),
                "{library} in {ldd:?}"
            );
        }
        assert!(linking.needed.iter().any(|l| l.starts_with("libc.so")));
    }

    #[test]
    fn a_file_that_is_not_elf_is_refused() {
        assert!(linking(b"#!/bin/sh\n").is_err());
    }
}
