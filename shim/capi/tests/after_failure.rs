//! `tests/c/after_failure.c`: a C program whose engine panics under it (`TBRDMA_FAULTS
//! panic_after`) keeps calling the API, then frees every object it holds. Every call must
//! return, the failure must be named, and nothing may abort, crash or hang (a panic crossing
//! the C boundary would abort the program). Loopback only: no root. Needs `cc` (skips with a
//! message otherwise).

use std::path::Path;
use std::process::Command;

mod common;
use common::{library_dir, show};

#[test]
fn a_c_program_frees_every_object_after_its_engine_failed() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = std::env::temp_dir().join(format!("tbrdma-capi-af-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp folder");
    let exe = dir.join("after_failure");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-O2", "-Wall", "-Wextra", "-Werror", "-pthread", "-o"])
        .arg(&exe)
        .arg(root.join("tests/c/after_failure.c"))
        .arg("-I")
        .arg(root.join("include"))
        .arg("-L")
        .arg(library_dir())
        .arg("-ltbrdma")
        .status();
    match built {
        Err(e) => {
            eprintln!("skipping: no C compiler ({cc}: {e})");
            let _ = std::fs::remove_dir_all(&dir);
            return;
        }
        Ok(s) => assert!(s.success(), "compiling tests/c/after_failure.c failed"),
    }
    // Each engine panics on the 40th datagram one of its rails receives: after the handshake,
    // during the WRITEs.
    let out = Command::new("timeout")
        .arg("60")
        .arg(&exe)
        .env("LD_LIBRARY_PATH", library_dir())
        .env("TBRDMA_FAULTS", "panic_after=40")
        .output()
        .expect("run the program");
    let _ = std::fs::remove_dir_all(&dir);
    let text = show(&out);
    assert_eq!(
        out.status.code(),
        Some(0),
        "the program must end on its own with 0 (124: it hung; none: a signal, such as an \
         abort from a panic through the C boundary):\n{text}"
    );
    assert!(
        text.contains("the tbrdma engine failed") || text.contains("completed with status"),
        "the failure reached the program: {text}"
    );
    assert!(text.contains("after the failure: poll_cq"), "{text}");
    assert!(text.contains("freed every object"), "{text}");
}
