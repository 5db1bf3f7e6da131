//! The provider-facing half of libibverbs' ABI (`IBVERBS_PRIVATE_34`) and the kernel-structure
//! helpers of `IBVERBS_1.0/1.1` that only rdma-core's own providers and librdmacm use.
//!
//! Debian links perftest with `libmlx5.so.1`, `libefa.so.1` and `librdmacm.so.1`, and every
//! object is linked with `BIND_NOW`: each symbol they import must exist, or the program does
//! not start. Their constructors register a driver (`verbs_register_driver_34`, a no-op here),
//! and nothing else is ever reached, because this library creates its devices itself and never
//! hands one to a provider. So these answer EOPNOTSUPP (or NULL, or nothing) and are never
//! expected to run; none dereferences its arguments.

use std::ffi::{c_int, c_void};
use std::sync::atomic::AtomicBool;

/// Declares `.symver` bindings: `name` exported as `name@@VERSION` (the default version).
macro_rules! versioned {
    ($version:literal: $($name:ident),+ $(,)?) => {
        $(std::arch::global_asm!(concat!(
            ".symver ", stringify!($name), ", ", stringify!($name), "@@", $version
        ));)+
    };
}
pub(crate) use versioned;

/// Defines functions that take anything and return `$ret`.
macro_rules! stub {
    ($ret:expr => $($name:ident),+ $(,)?) => {
        $(
            #[unsafe(no_mangle)]
            extern "C" fn $name() -> c_int {
                $ret
            }
        )+
    };
}

stub!(libc::EOPNOTSUPP =>
    ibv_cmd_advise_mr, ibv_cmd_alloc_dm, ibv_cmd_alloc_mw, ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast, ibv_cmd_close_xrcd, ibv_cmd_create_ah, ibv_cmd_create_counters,
    ibv_cmd_create_cq_ex, ibv_cmd_create_flow, ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp_ex2, ibv_cmd_create_qp_ex, ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq, ibv_cmd_create_srq_ex, ibv_cmd_create_wq, ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd, ibv_cmd_dereg_mr, ibv_cmd_destroy_ah, ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq, ibv_cmd_destroy_flow, ibv_cmd_destroy_flow_action, ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table, ibv_cmd_destroy_srq, ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast, ibv_cmd_free_dm, ibv_cmd_get_context, ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp, ibv_cmd_modify_qp, ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq, ibv_cmd_modify_wq, ibv_cmd_open_qp, ibv_cmd_open_xrcd,
    ibv_cmd_query_context, ibv_cmd_query_device_any, ibv_cmd_query_mr, ibv_cmd_query_port,
    ibv_cmd_query_qp, ibv_cmd_query_srq, ibv_cmd_read_counters, ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr, ibv_cmd_reg_mr, ibv_cmd_rereg_mr, ibv_cmd_resize_cq,
    execute_ioctl,
);

versioned!("IBVERBS_PRIVATE_34":
    ibv_cmd_advise_mr, ibv_cmd_alloc_dm, ibv_cmd_alloc_mw, ibv_cmd_alloc_pd,
    ibv_cmd_attach_mcast, ibv_cmd_close_xrcd, ibv_cmd_create_ah, ibv_cmd_create_counters,
    ibv_cmd_create_cq_ex, ibv_cmd_create_flow, ibv_cmd_create_flow_action_esp,
    ibv_cmd_create_qp_ex2, ibv_cmd_create_qp_ex, ibv_cmd_create_rwq_ind_table,
    ibv_cmd_create_srq, ibv_cmd_create_srq_ex, ibv_cmd_create_wq, ibv_cmd_dealloc_mw,
    ibv_cmd_dealloc_pd, ibv_cmd_dereg_mr, ibv_cmd_destroy_ah, ibv_cmd_destroy_counters,
    ibv_cmd_destroy_cq, ibv_cmd_destroy_flow, ibv_cmd_destroy_flow_action, ibv_cmd_destroy_qp,
    ibv_cmd_destroy_rwq_ind_table, ibv_cmd_destroy_srq, ibv_cmd_destroy_wq,
    ibv_cmd_detach_mcast, ibv_cmd_free_dm, ibv_cmd_get_context, ibv_cmd_modify_cq,
    ibv_cmd_modify_flow_action_esp, ibv_cmd_modify_qp, ibv_cmd_modify_qp_ex,
    ibv_cmd_modify_srq, ibv_cmd_modify_wq, ibv_cmd_open_qp, ibv_cmd_open_xrcd,
    ibv_cmd_query_context, ibv_cmd_query_device_any, ibv_cmd_query_mr, ibv_cmd_query_port,
    ibv_cmd_query_qp, ibv_cmd_query_srq, ibv_cmd_read_counters, ibv_cmd_reg_dm_mr,
    ibv_cmd_reg_dmabuf_mr, ibv_cmd_reg_mr, ibv_cmd_rereg_mr, ibv_cmd_resize_cq,
    execute_ioctl,
);

/// A provider library's constructor registers itself: nothing to do, no device is ever its.
#[unsafe(no_mangle)]
extern "C" fn verbs_register_driver_34(_ops: *const c_void) {}

/// Never called (this library opens its own devices).
#[unsafe(no_mangle)]
extern "C" fn verbs_open_device(_device: *mut c_void, _private: *mut c_void) -> *mut c_void {
    std::ptr::null_mut()
}

/// Never called.
#[unsafe(no_mangle)]
extern "C" fn _verbs_init_and_alloc_context() -> *mut c_void {
    std::ptr::null_mut()
}

/// Never called.
#[unsafe(no_mangle)]
extern "C" fn verbs_init_cq() -> c_int {
    libc::EOPNOTSUPP
}

/// Never called.
#[unsafe(no_mangle)]
extern "C" fn verbs_set_ops(_context: *mut c_void, _ops: *const c_void) {}

/// Never called.
#[unsafe(no_mangle)]
extern "C" fn verbs_uninit_context(_context: *mut c_void) {}

/// Providers log through this (`verbs_err` and friends); nothing reaches it here.
#[unsafe(no_mangle)]
extern "C" fn __verbs_log(_context: *mut c_void, _level: u32, _fmt: *const c_void) {}

/// A boolean providers read (rdma-core: whether destroy may proceed on a disassociated device).
#[unsafe(no_mangle)]
static verbs_allow_disassociate_destroy: AtomicBool = AtomicBool::new(false);

versioned!("IBVERBS_PRIVATE_34":
    verbs_register_driver_34, verbs_open_device, _verbs_init_and_alloc_context, verbs_init_cq,
    verbs_set_ops, verbs_uninit_context, __verbs_log, verbs_allow_disassociate_destroy,
);

/// Kernel-structure conversions librdmacm uses with the kernel's rdma_cm (never here).
#[unsafe(no_mangle)]
extern "C" fn ibv_copy_path_rec_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[unsafe(no_mangle)]
extern "C" fn ibv_copy_path_rec_to_kern(_dst: *mut c_void, _src: *const c_void) {}
#[unsafe(no_mangle)]
extern "C" fn ibv_copy_qp_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}
#[unsafe(no_mangle)]
extern "C" fn ibv_copy_ah_attr_from_kern(_dst: *mut c_void, _src: *const c_void) {}

versioned!("IBVERBS_1.0":
    ibv_copy_path_rec_from_kern, ibv_copy_path_rec_to_kern, ibv_copy_qp_attr_from_kern,
);
versioned!("IBVERBS_1.1": ibv_copy_ah_attr_from_kern);
