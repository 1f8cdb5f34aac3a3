//! Ask bpf-linker for BTF: socket-local storage maps cannot be created without it.
fn main() {
    println!("cargo:rustc-link-arg=--btf");
}
