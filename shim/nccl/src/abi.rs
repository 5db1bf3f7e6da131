//! The NCCL net-plugin ABI, restated in Rust: result codes, constants and the `#[repr(C)]`
//! property structs of v8 to v11, with their sizes and offsets checked at compile time
//! against `shared/design/nccl-net-plugin.md` section 3 (x86_64, LP64). The function tables
//! themselves live in `ffi.rs`, next to the functions they point at. Nothing here runs.

use std::ffi::{c_char, c_int, c_ulong, c_void};
use std::mem::{offset_of, size_of};

/// `ncclResult_t`: every entry point returns one (a plain C enum, 4 bytes).
pub type NcclResult = c_int;
/// Success.
pub const NCCL_SUCCESS: NcclResult = 0;
/// Syscall, network or hardware failure: the usual plugin error.
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
/// NCCL misused the plugin (bad arguments, unknown handle).
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
/// User or configuration error, e.g. a receive buffer too small for the message.
pub const NCCL_INVALID_USAGE: NcclResult = 5;
/// The peer died or the remote side failed.
pub const NCCL_REMOTE_ERROR: NcclResult = 6;

/// `ncclDebugLogLevel` values the plugin uses.
pub const NCCL_LOG_WARN: c_int = 2;
/// Informational messages (shown with `NCCL_DEBUG=INFO`).
pub const NCCL_LOG_INFO: c_int = 3;
/// Subsystem masks: initialisation.
pub const NCCL_INIT: c_ulong = 0x1;
/// Subsystem masks: network.
pub const NCCL_NET: c_ulong = 0x10;
/// Subsystem masks: every subsystem (for warnings).
pub const NCCL_ALL: c_ulong = !0;

/// Bytes of the opaque listen handle NCCL ships to the peer.
pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;
/// Host memory.
pub const NCCL_PTR_HOST: c_int = 0x1;
/// Concurrent requests each comm must accept.
pub const NCCL_NET_MAX_REQUESTS: usize = 32;
/// `NCCL_NET_DEVICE_HOST`: no device offload.
pub const NCCL_NET_DEVICE_HOST: c_int = 0;
/// Per-message cap NCCL assumes for v8 and older (1 GiB).
pub const MAX_NET_SIZE: usize = 1 << 30;

/// `ncclDebugLogger_t`: printf-style, variadic.
pub type Logger = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;

/// `ncclProfilerCallback_t` (v10+): accepted and ignored.
pub type ProfilerCallback = Option<
    unsafe extern "C" fn(
        e_handle: *mut *mut c_void,
        kind: c_int,
        p_handle: *mut c_void,
        plugin_id: i64,
        ext_data: *mut c_void,
    ) -> NcclResult,
>;

/// `ncclNetCommConfig_t` (v10+).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct CommConfig {
    /// Traffic class, -1 when undefined (tbrdma has no traffic classes and ignores it).
    pub traffic_class: c_int,
}

/// `ncclNetProperties_v8` (64 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV8 {
    /// Device name (static storage).
    pub name: *mut c_char,
    /// sysfs path, NULL for a virtual NIC.
    pub pci_path: *mut c_char,
    /// Devices with the same guid are one physical port.
    pub guid: u64,
    /// `NCCL_PTR_*` bits.
    pub ptr_support: c_int,
    /// Registrations are global and cached.
    pub reg_is_global: c_int,
    /// Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Microseconds, 0 = NCCL's default.
    pub latency: f32,
    /// Most send + receive comms.
    pub max_comms: c_int,
    /// Most receives grouped in one `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Device-offload version.
    pub net_device_version: c_int,
}

/// `ncclNetVDeviceProps_v9` (also v10 and v11): physical devices fused into one.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct VDeviceProps {
    /// Number of entries in `devs`.
    pub ndevs: c_int,
    /// Physical device indices.
    pub devs: [c_int; 4],
}

/// `ncclNetProperties_v9`, identical to v10 (104 bytes).
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV9 {
    /// Device name.
    pub name: *mut c_char,
    /// sysfs path or NULL.
    pub pci_path: *mut c_char,
    /// Physical port identity.
    pub guid: u64,
    /// `NCCL_PTR_*` bits.
    pub ptr_support: c_int,
    /// Registrations are global.
    pub reg_is_global: c_int,
    /// Ask NCCL to flush after GPU receives.
    pub force_flush: c_int,
    /// Mbit/s.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Microseconds.
    pub latency: f32,
    /// Most comms.
    pub max_comms: c_int,
    /// Most grouped receives.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Device-offload version.
    pub net_device_version: c_int,
    /// Fused physical devices.
    pub vprops: VDeviceProps,
    /// Largest point-to-point message.
    pub max_p2p_bytes: usize,
    /// Largest collective message.
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11` (112 bytes): v10 plus `maxMultiRequestSize`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct PropertiesV11 {
    /// The v9/v10 fields.
    pub base: PropertiesV9,
    /// Most requests NCCL may merge (the core does not use it yet).
    pub max_multi_request_size: c_int,
}

const _: () = {
    assert!(size_of::<PropertiesV8>() == 64);
    assert!(offset_of!(PropertiesV8, ptr_support) == 24);
    assert!(offset_of!(PropertiesV8, latency) == 40);
    assert!(offset_of!(PropertiesV8, net_device_version) == 56);
    assert!(size_of::<VDeviceProps>() == 20);
    assert!(size_of::<PropertiesV9>() == 104);
    assert!(offset_of!(PropertiesV9, force_flush) == 32);
    assert!(offset_of!(PropertiesV9, latency) == 44);
    assert!(offset_of!(PropertiesV9, net_device_version) == 60);
    assert!(offset_of!(PropertiesV9, vprops) == 64);
    assert!(offset_of!(PropertiesV9, max_p2p_bytes) == 88);
    assert!(offset_of!(PropertiesV9, max_coll_bytes) == 96);
    assert!(size_of::<PropertiesV11>() == 112);
    assert!(offset_of!(PropertiesV11, max_multi_request_size) == 104);
    assert!(size_of::<CommConfig>() == 4);
};
