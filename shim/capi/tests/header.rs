//! `include/tbrdma.h` is what cbindgen generates from this crate today: CI fails when the
//! committed header is stale. `TBRDMA_BLESS=1` rewrites it instead.

use std::path::Path;

#[test]
fn the_committed_header_is_what_cbindgen_generates() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).expect("cbindgen.toml");
    let mut generated = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen")
        .write(&mut generated);
    let generated = String::from_utf8(generated).expect("UTF-8 header");
    let path = dir.join("include/tbrdma.h");
    if std::env::var_os("TBRDMA_BLESS").is_some() {
        std::fs::write(&path, &generated).expect("write the header");
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == generated,
        "shim/capi/include/tbrdma.h is stale: regenerate it with \
         `TBRDMA_BLESS=1 cargo test -p tbrdma-capi --test header` and commit it"
    );
}
