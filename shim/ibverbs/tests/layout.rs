//! The layouts and constants of `src/abi.rs` against the system's `<infiniband/verbs.h>`:
//! static assertions compiled by the C compiler. Skips (saying why) without a C compiler or
//! without the header (Debian: `libibverbs-dev`).

use std::path::Path;
use std::process::Command;

#[test]
fn layouts_and_constants_match_the_system_verbs_h() {
    if !Path::new("/usr/include/infiniband/verbs.h").exists() {
        eprintln!("SKIPPED: /usr/include/infiniband/verbs.h not found (install libibverbs-dev)");
        return;
    }
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let mut src = String::from("#include <stddef.h>\n#include <infiniband/verbs.h>\n");
    let checks = ibverbs::abi::layout_checks();
    for (i, (expr, value)) in checks.iter().enumerate() {
        src.push_str(&format!(
            "_Static_assert({expr} == {value}u, \"check {i}: {expr} is not {value}\");\n"
        ));
    }
    let dir = std::env::temp_dir().join(format!("tbrdma-ibv-layout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("layout.c");
    std::fs::write(&file, src).unwrap();
    let out = match Command::new(&cc).arg("-fsyntax-only").arg(&file).output() {
        Ok(out) => out,
        Err(e) => {
            eprintln!("SKIPPED: no C compiler ({cc}: {e})");
            return;
        }
    };
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        out.status.success(),
        "{} of the layout checks failed against verbs.h:\n{}",
        checks.len(),
        String::from_utf8_lossy(&out.stderr)
    );
    eprintln!("{} layout checks agree with verbs.h", checks.len());
}
