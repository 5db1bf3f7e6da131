//! Link flags of the plugin: `-z nodelete` keeps the library mapped when NCCL `dlclose`s it,
//! so threads of open comms never run unmapped code (pitfall P4 of the design notes).

fn main() {
    println!("cargo:rustc-cdylib-link-arg=-Wl,-z,nodelete");
}
