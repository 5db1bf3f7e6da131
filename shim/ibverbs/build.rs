//! Link flags of the library: the soname `libibverbs.so.1`, and the version nodes of rdma-core's
//! libibverbs (`libibverbs.map`). The symbols get their versions from `.symver` directives in
//! `src/exports.rs` (rustc passes its own anonymous version script for a cdylib, which would
//! otherwise leave them unversioned); the map only defines the nodes they name.

fn main() {
    let dir = std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR");
    println!("cargo:rerun-if-changed=libibverbs.map");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libibverbs.so.1");
    println!("cargo:rustc-cdylib-link-arg=-Wl,--version-script={dir}/libibverbs.map");
    // Threads of open devices may run after a dlclose by a plugin loader (NCCL): stay mapped.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
