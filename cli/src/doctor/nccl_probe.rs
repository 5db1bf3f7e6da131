//! Loads an NCCL net plugin as NCCL does and reports what it found, as one JSON line on stdout:
//! the hidden `tbrdma nccl-probe PATH`, which `tbrdma doctor --nccl` runs as a child so a plugin
//! that crashes in `init` fails a check instead of the doctor.
//!
//! Unsafe file: `dlopen`, `dlsym` and calls into the loaded library's `init` and `devices`.

use std::ffi::{CStr, c_char, c_int, c_void};

use serde::Serialize;

/// The table versions NCCL ≥ 2.19 and RCCL look for, newest first.
pub const VERSIONS: [&str; 4] = [
    "ncclNetPlugin_v11",
    "ncclNetPlugin_v10",
    "ncclNetPlugin_v9",
    "ncclNetPlugin_v8",
];

/// What the probe found.
#[derive(Debug, Serialize, serde::Deserialize)]
pub struct Found {
    /// `dlopen` succeeded (else `error` says why).
    pub loaded: bool,
    /// The exported tables among [`VERSIONS`].
    pub tables: Vec<String>,
    /// `ncclNet_t.name` of the v8 table (what `NCCL_NET` matches).
    pub name: Option<String>,
    /// `init`'s ncclResult_t (0: ncclSuccess).
    pub init: Option<i32>,
    /// `devices`' count, when `init` succeeded.
    pub devices: Option<i32>,
    /// dlopen's message, or what was missing.
    pub error: Option<String>,
}

/// The head of `ncclNet_v8_t`: the fields the probe reads, laid out as in `nccl_net.h`.
#[repr(C)]
struct NetV8Head {
    name: *const c_char,
    init: Option<unsafe extern "C" fn(logger: *const c_void) -> c_int>,
    devices: Option<unsafe extern "C" fn(ndev: *mut c_int) -> c_int>,
}

/// Runs the probe on `path` and prints its JSON line.
pub fn run(path: &str) -> anyhow::Result<()> {
    let found = probe(path);
    println!("{}", serde_json::to_string(&found)?);
    Ok(())
}

fn probe(path: &str) -> Found {
    let mut found = Found {
        loaded: false,
        tables: Vec::new(),
        name: None,
        init: None,
        devices: None,
        error: None,
    };
    // SAFETY: loading runs the library's initialisers; that is what this probe is for, in a
    // child process of its own so a misbehaving library takes only the probe down. RTLD_NOW and
    // RTLD_LOCAL as NCCL's loader uses them.
    let lib = match unsafe {
        libloading::os::unix::Library::open(
            Some(path),
            libloading::os::unix::RTLD_NOW | libloading::os::unix::RTLD_LOCAL,
        )
    } {
        Ok(lib) => lib,
        Err(e) => {
            found.error = Some(e.to_string());
            return found;
        }
    };
    found.loaded = true;
    for version in VERSIONS {
        // SAFETY: only the symbol's address is taken; nothing is read through it here.
        if unsafe { lib.get::<*const c_void>(version.as_bytes()) }.is_ok() {
            found.tables.push(version.to_owned());
        }
    }
    // SAFETY: `ncclNetPlugin_v8` is a data symbol of type `ncclNet_v8_t` in every NCCL net plugin
    // that exports it; `NetV8Head` is that struct's first three fields with the same layout, and
    // the library stays loaded (`lib`) while the table is used.
    let table: *const NetV8Head = match unsafe { lib.get::<*const NetV8Head>(b"ncclNetPlugin_v8") }
    {
        Ok(symbol) => *symbol,
        Err(_) => {
            found.error = Some("no ncclNetPlugin_v8 table: init was not tried".into());
            return found;
        }
    };
    // SAFETY: `table` points at the plugin's static table (see above).
    let head = unsafe { &*table };
    if !head.name.is_null() {
        // SAFETY: `name` is a NUL-terminated static string per nccl_net.h.
        found.name = Some(
            unsafe { CStr::from_ptr(head.name) }
                .to_string_lossy()
                .into_owned(),
        );
    }
    let (Some(init), Some(devices)) = (head.init, head.devices) else {
        found.error = Some("the v8 table has no init or devices function".into());
        return found;
    };
    // SAFETY: `init(ncclDebugLogger_t)` per nccl_net.h; a NULL logger is allowed (the plugin
    // then prints warnings on stderr).
    let rc = unsafe { init(std::ptr::null()) };
    found.init = Some(rc);
    if rc == 0 {
        let mut n: c_int = 0;
        // SAFETY: `devices(int*)` writes the count through a valid pointer.
        let rc = unsafe { devices(&mut n) };
        if rc == 0 {
            found.devices = Some(n);
        } else {
            found.error = Some(format!("devices() returned ncclResult_t {rc}"));
        }
    }
    // Not unloaded: the plugin is linked `-z nodelete`, and the process exits next.
    std::mem::forget(lib);
    found
}
