//! Link flags of the plugin: `-z nodelete` keeps the library mapped when NCCL `dlclose`s it,
//! so threads of open comms never run unmapped code (pitfall P4 of the design notes), and the
//! version script `exports.map` exports the `ncclNetPlugin_vN` tables and nothing else.

fn main() {
    let map = std::path::Path::new(&std::env::var("CARGO_MANIFEST_DIR").expect("manifest dir"))
        .join("exports.map");
    println!("cargo:rerun-if-changed={}", map.display());
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
    println!(
        "cargo:rustc-cdylib-link-arg=-Wl,--version-script={}",
        map.display()
    );
    // rustc passes a version script of its own that exports every `#[no_mangle]` function of
    // every crate linked in (crc-fast's C API, for one); the dependencies arrive as archives
    // (rlibs), and `--exclude-libs` keeps what archives define out of the dynamic symbol table.
    println!("cargo:rustc-cdylib-link-arg=-Wl,--exclude-libs,ALL");
}
