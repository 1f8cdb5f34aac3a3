//! The architectures the image is built for, and what each is called by the tools that build it:
//! OCI's platform, Rust's target, Debian's architecture and multiarch directory, the cross
//! compiler.
//!
//! Debian's cross compilers: `gcc-aarch64-linux-gnu` on amd64, `gcc-x86-64-linux-gnu` on arm64.

/// One platform of the image.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Arch {
    /// OCI's (and Go's) name: `amd64`, `arm64`; release files are named by it.
    pub oci: &'static str,
    /// OCI's platform variant: `v8` for arm64, as registries' multi-arch images say and
    /// containerd's platform matcher normalises arm64 to.
    pub variant: Option<&'static str>,
    /// The Rust target the static binaries build for.
    pub rust_target: &'static str,
    /// Debian's architecture name (`dpkg --print-architecture`).
    pub debian: &'static str,
    /// Debian's multiarch directory: `/usr/lib/<triplet>` holds the libraries, and
    /// `<triplet>-gcc` is the cross compiler (package `gcc-<triplet>`).
    pub triplet: &'static str,
    /// ELF `e_machine` of its binaries.
    pub elf_machine: u16,
    /// The C cross compiler (and linker) that builds for it on another machine, and its Debian
    /// package.
    pub gcc: &'static str,
    pub gcc_package: &'static str,
    /// Its C library for that cross compiler (crt files, static libc).
    pub libc_dev_package: &'static str,
}

pub const AMD64: Arch = Arch {
    oci: "amd64",
    variant: None,
    rust_target: "x86_64-unknown-linux-gnu",
    debian: "amd64",
    triplet: "x86_64-linux-gnu",
    elf_machine: object::elf::EM_X86_64,
    gcc: "x86_64-linux-gnu-gcc",
    gcc_package: "gcc-x86-64-linux-gnu",
    libc_dev_package: "libc6-dev-amd64-cross",
};

pub const ARM64: Arch = Arch {
    oci: "arm64",
    variant: Some("v8"),
    rust_target: "aarch64-unknown-linux-gnu",
    debian: "arm64",
    triplet: "aarch64-linux-gnu",
    elf_machine: object::elf::EM_AARCH64,
    gcc: "aarch64-linux-gnu-gcc",
    gcc_package: "gcc-aarch64-linux-gnu",
    libc_dev_package: "libc6-dev-arm64-cross",
};

/// Every platform of the image, the index's order.
pub const ALL: [Arch; 2] = [AMD64, ARM64];

impl Arch {
    /// The architecture of the machine building (and testing) the image.
    pub fn host() -> Self {
        match std::env::consts::ARCH {
            "aarch64" => ARM64,
            _ => AMD64,
        }
    }

    pub fn is_host(self) -> bool {
        self == Self::host()
    }

    /// `linux/arm64/v8`, as `ctr --platform` and docker take it.
    pub fn platform(self) -> String {
        match self.variant {
            Some(variant) => format!("linux/{}/{variant}", self.oci),
            None => format!("linux/{}", self.oci),
        }
    }

    /// The C cross compiler and linker for this architecture (`None` on its own machine).
    pub fn cross_gcc(self) -> Option<&'static str> {
        (!self.is_host()).then_some(self.gcc)
    }

    /// The image's other platforms than this machine's.
    pub fn foreign() -> impl Iterator<Item = Self> {
        ALL.into_iter().filter(|a| !a.is_host())
    }

    /// Has `cargo` link this architecture's binaries (and compile its C) with the cross
    /// compiler, where it is not this machine's.
    pub fn link_with_cross_compiler(self, cargo: &mut std::process::Command) {
        if let Some(gcc) = self.cross_gcc() {
            cargo
                .env(format!("{}_LINKER", self.cargo_env_prefix()), gcc)
                .env(format!("CC_{}", self.rust_target.replace('-', "_")), gcc);
        }
    }

    /// `CARGO_TARGET_<TRIPLE>_…`: the prefix of cargo's per-target variables.
    pub fn cargo_env_prefix(self) -> String {
        format!(
            "CARGO_TARGET_{}",
            self.rust_target.to_uppercase().replace('-', "_")
        )
    }
}
