//! The C layouts and constants of rdma-core's `<infiniband/verbs.h>` (x86-64 and aarch64
//! Linux, LP64) that this library hands to applications or reads from them. Only what the
//! library touches is spelled out; opaque tails are byte arrays of the right size.
//!
//! Every offset, size and constant here is checked against the system's `verbs.h` by
//! `tests/layout.rs`, which compiles static assertions generated from [`layout_checks`] (CI
//! installs `libibverbs-dev`; without the header the test says so and skips).

#![allow(non_camel_case_types)]
// C mirrors: their Debug would print raw pointers and byte arrays.
#![allow(missing_debug_implementations)]

use std::ffi::{c_char, c_int, c_uint, c_void};

pub const IBV_SYSFS_NAME_MAX: usize = 64;
pub const IBV_SYSFS_PATH_MAX: usize = 256;

/// `struct ibv_device`. Its first member is `struct _ibv_device_ops` (two obsolete function
/// pointers, always NULL here).
#[repr(C)]
pub struct ibv_device {
    pub _ops: [*mut c_void; 2],
    pub node_type: c_int,
    pub transport_type: c_int,
    pub name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_name: [c_char; IBV_SYSFS_NAME_MAX],
    pub dev_path: [c_char; IBV_SYSFS_PATH_MAX],
    pub ibdev_path: [c_char; IBV_SYSFS_PATH_MAX],
}

/// `struct ibv_context_ops`: the operations `verbs.h`'s inline functions call.
#[repr(C)]
pub struct ibv_context_ops {
    pub _compat_query_device: *mut c_void,
    pub _compat_query_port: *mut c_void,
    pub _compat: [*mut c_void; 5],
    pub alloc_mw: *mut c_void,
    pub bind_mw: *mut c_void,
    pub dealloc_mw: *mut c_void,
    pub _compat_create_cq: *mut c_void,
    pub poll_cq: Option<PollCqFn>,
    pub req_notify_cq: Option<ReqNotifyCqFn>,
    pub _compat2: [*mut c_void; 7],
    pub post_srq_recv: Option<PostSrqRecvFn>,
    pub _compat3: [*mut c_void; 4],
    pub post_send: Option<PostSendFn>,
    pub post_recv: Option<PostRecvFn>,
    pub _compat4: [*mut c_void; 5],
}

pub type PollCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int, *mut ibv_wc) -> c_int;
pub type ReqNotifyCqFn = unsafe extern "C" fn(*mut ibv_cq, c_int) -> c_int;
pub type PostSrqRecvFn =
    unsafe extern "C" fn(*mut c_void, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type PostSendFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_send_wr, *mut *mut ibv_send_wr) -> c_int;
pub type PostRecvFn =
    unsafe extern "C" fn(*mut ibv_qp, *mut ibv_recv_wr, *mut *mut ibv_recv_wr) -> c_int;
pub type QueryPortFn =
    unsafe extern "C" fn(*mut ibv_context, u8, *mut ibv_port_attr, usize) -> c_int;

/// `struct ibv_context`.
#[repr(C)]
pub struct ibv_context {
    pub device: *mut ibv_device,
    pub ops: ibv_context_ops,
    pub cmd_fd: c_int,
    pub async_fd: c_int,
    pub num_comp_vectors: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub abi_compat: *mut c_void,
}

/// Slots of `struct verbs_context` in front of `sz` (newest first: the struct "grows up").
pub const VERBS_CONTEXT_SLOTS: usize = 39;

/// `struct verbs_context`: the extended operations, `sz`, then the `ibv_context`. Only
/// `query_port` (slot 0) is filled; `verbs.h` falls back to the exported functions for the
/// NULL ones (or answers EOPNOTSUPP).
#[repr(C)]
pub struct verbs_context {
    pub query_port: Option<QueryPortFn>,
    pub _other_ops: [*mut c_void; VERBS_CONTEXT_SLOTS - 1],
    pub sz: usize,
    pub context: ibv_context,
}

/// `__VERBS_ABI_IS_EXTENDED`: `ibv_context.abi_compat` of a `verbs_context`.
pub const VERBS_ABI_IS_EXTENDED: *mut c_void = usize::MAX as *mut c_void;

/// `struct ibv_device_attr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_device_attr {
    pub fw_ver: [c_char; 64],
    pub node_guid: u64,
    pub sys_image_guid: u64,
    pub max_mr_size: u64,
    pub page_size_cap: u64,
    pub vendor_id: u32,
    pub vendor_part_id: u32,
    pub hw_ver: u32,
    pub max_qp: c_int,
    pub max_qp_wr: c_int,
    pub device_cap_flags: c_uint,
    pub max_sge: c_int,
    pub max_sge_rd: c_int,
    pub max_cq: c_int,
    pub max_cqe: c_int,
    pub max_mr: c_int,
    pub max_pd: c_int,
    pub max_qp_rd_atom: c_int,
    pub max_ee_rd_atom: c_int,
    pub max_res_rd_atom: c_int,
    pub max_qp_init_rd_atom: c_int,
    pub max_ee_init_rd_atom: c_int,
    pub atomic_cap: c_int,
    pub max_ee: c_int,
    pub max_rdd: c_int,
    pub max_mw: c_int,
    pub max_raw_ipv6_qp: c_int,
    pub max_raw_ethy_qp: c_int,
    pub max_mcast_grp: c_int,
    pub max_mcast_qp_attach: c_int,
    pub max_total_mcast_qp_attach: c_int,
    pub max_ah: c_int,
    pub max_fmr: c_int,
    pub max_map_per_fmr: c_int,
    pub max_srq: c_int,
    pub max_srq_wr: c_int,
    pub max_srq_sge: c_int,
    pub max_pkeys: u16,
    pub local_ca_ack_delay: u8,
    pub phys_port_cnt: u8,
}

/// `struct ibv_port_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_port_attr {
    pub state: c_int,
    pub max_mtu: c_int,
    pub active_mtu: c_int,
    pub gid_tbl_len: c_int,
    pub port_cap_flags: u32,
    pub max_msg_sz: u32,
    pub bad_pkey_cntr: u32,
    pub qkey_viol_cntr: u32,
    pub pkey_tbl_len: u16,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub max_vl_num: u8,
    pub sm_sl: u8,
    pub subnet_timeout: u8,
    pub init_type_reply: u8,
    pub active_width: u8,
    pub active_speed: u8,
    pub phys_state: u8,
    pub link_layer: u8,
    pub flags: u8,
    pub port_cap_flags2: u16,
}

/// Bytes of `struct _compat_ibv_port_attr` that the exported `ibv_query_port` fills: every
/// field before `flags` (the caller's struct may be that old).
pub const COMPAT_PORT_ATTR_LEN: usize = std::mem::offset_of!(ibv_port_attr, flags);

/// `union ibv_gid` (16 bytes, aligned as its two `__be64` halves).
#[repr(C, align(8))]
#[derive(Clone, Copy, Default, PartialEq, Eq, Debug)]
pub struct ibv_gid {
    pub raw: [u8; 16],
}

/// `struct ibv_gid_entry`.
#[repr(C)]
#[derive(Clone, Copy, Default)]
pub struct ibv_gid_entry {
    pub gid: ibv_gid,
    pub gid_index: u32,
    pub port_num: u32,
    pub gid_type: u32,
    pub ndev_ifindex: u32,
}

/// `struct ibv_pd`.
#[repr(C)]
pub struct ibv_pd {
    pub context: *mut ibv_context,
    pub handle: u32,
}

/// `struct ibv_mr`.
#[repr(C)]
pub struct ibv_mr {
    pub context: *mut ibv_context,
    pub pd: *mut ibv_pd,
    pub addr: *mut c_void,
    pub length: usize,
    pub handle: u32,
    pub lkey: u32,
    pub rkey: u32,
}

/// `struct ibv_comp_channel`.
#[repr(C)]
pub struct ibv_comp_channel {
    pub context: *mut ibv_context,
    pub fd: c_int,
    pub refcnt: c_int,
}

/// `struct ibv_cq`.
#[repr(C)]
pub struct ibv_cq {
    pub context: *mut ibv_context,
    pub channel: *mut ibv_comp_channel,
    pub cq_context: *mut c_void,
    pub handle: u32,
    pub cqe: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub comp_events_completed: u32,
    pub async_events_completed: u32,
}

/// `struct ibv_qp`.
#[repr(C)]
pub struct ibv_qp {
    pub context: *mut ibv_context,
    pub qp_context: *mut c_void,
    pub pd: *mut ibv_pd,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub handle: u32,
    pub qp_num: u32,
    pub state: c_int,
    pub qp_type: c_int,
    pub mutex: libc::pthread_mutex_t,
    pub cond: libc::pthread_cond_t,
    pub events_completed: u32,
}

/// `struct ibv_qp_cap`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_cap {
    pub max_send_wr: u32,
    pub max_recv_wr: u32,
    pub max_send_sge: u32,
    pub max_recv_sge: u32,
    pub max_inline_data: u32,
}

/// `struct ibv_qp_init_attr`.
#[repr(C)]
pub struct ibv_qp_init_attr {
    pub qp_context: *mut c_void,
    pub send_cq: *mut ibv_cq,
    pub recv_cq: *mut ibv_cq,
    pub srq: *mut c_void,
    pub cap: ibv_qp_cap,
    pub qp_type: c_int,
    pub sq_sig_all: c_int,
}

/// `struct ibv_global_route`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_global_route {
    pub dgid: ibv_gid,
    pub flow_label: u32,
    pub sgid_index: u8,
    pub hop_limit: u8,
    pub traffic_class: u8,
}

/// `struct ibv_ah_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_ah_attr {
    pub grh: ibv_global_route,
    pub dlid: u16,
    pub sl: u8,
    pub src_path_bits: u8,
    pub static_rate: u8,
    pub is_global: u8,
    pub port_num: u8,
}

/// `struct ibv_qp_attr`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_qp_attr {
    pub qp_state: c_int,
    pub cur_qp_state: c_int,
    pub path_mtu: c_int,
    pub path_mig_state: c_int,
    pub qkey: u32,
    pub rq_psn: u32,
    pub sq_psn: u32,
    pub dest_qp_num: u32,
    pub qp_access_flags: c_uint,
    pub cap: ibv_qp_cap,
    pub ah_attr: ibv_ah_attr,
    pub alt_ah_attr: ibv_ah_attr,
    pub pkey_index: u16,
    pub alt_pkey_index: u16,
    pub en_sqd_async_notify: u8,
    pub sq_draining: u8,
    pub max_rd_atomic: u8,
    pub max_dest_rd_atomic: u8,
    pub min_rnr_timer: u8,
    pub port_num: u8,
    pub timeout: u8,
    pub retry_cnt: u8,
    pub rnr_retry: u8,
    pub alt_port_num: u8,
    pub alt_timeout: u8,
    pub rate_limit: u32,
}

/// `struct ibv_sge`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_sge {
    pub addr: u64,
    pub length: u32,
    pub lkey: u32,
}

/// The `rdma` member of `ibv_send_wr.wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_rdma {
    pub remote_addr: u64,
    pub rkey: u32,
}

/// The `atomic` member of `ibv_send_wr.wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct ibv_send_wr_atomic {
    pub remote_addr: u64,
    pub compare_add: u64,
    pub swap: u64,
    pub rkey: u32,
}

/// `ibv_send_wr.wr`.
#[repr(C)]
#[derive(Clone, Copy)]
pub union ibv_send_wr_wr {
    pub rdma: ibv_send_wr_rdma,
    pub atomic: ibv_send_wr_atomic,
    pub ud: [u64; 2],
}

/// `struct ibv_send_wr`. The tail (`qp_type`, `bind_mw`/`tso`) is never read.
#[repr(C)]
pub struct ibv_send_wr {
    pub wr_id: u64,
    pub next: *mut ibv_send_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
    pub opcode: c_int,
    pub send_flags: c_uint,
    /// `imm_data` (network byte order, carried as is) or `invalidate_rkey`.
    pub imm_data: u32,
    pub wr: ibv_send_wr_wr,
    pub qp_type: u32,
    pub _tail: [u64; 6],
}

/// `struct ibv_recv_wr`.
#[repr(C)]
pub struct ibv_recv_wr {
    pub wr_id: u64,
    pub next: *mut ibv_recv_wr,
    pub sg_list: *mut ibv_sge,
    pub num_sge: c_int,
}

/// `struct ibv_wc`.
#[repr(C)]
#[derive(Clone, Copy, Default, Debug)]
pub struct ibv_wc {
    pub wr_id: u64,
    pub status: c_int,
    pub opcode: c_int,
    pub vendor_err: u32,
    pub byte_len: u32,
    /// `imm_data` (network byte order) or `invalidated_rkey`.
    pub imm_data: u32,
    pub qp_num: u32,
    pub src_qp: u32,
    pub wc_flags: c_uint,
    pub pkey_index: u16,
    pub slid: u16,
    pub sl: u8,
    pub dlid_path_bits: u8,
}

/// `struct ibv_async_event`.
#[repr(C)]
pub struct ibv_async_event {
    pub element: *mut c_void,
    pub event_type: c_int,
}

// enum ibv_node_type, ibv_transport_type
pub const IBV_NODE_CA: c_int = 1;
pub const IBV_TRANSPORT_IB: c_int = 0;
// enum ibv_atomic_cap
pub const IBV_ATOMIC_HCA: c_int = 1;
// enum ibv_mtu
pub const IBV_MTU_1024: c_int = 3;
pub const IBV_MTU_4096: c_int = 5;
// enum ibv_port_state
pub const IBV_PORT_DOWN: c_int = 1;
pub const IBV_PORT_ACTIVE: c_int = 4;
// enum ibv_port_cap_flags
pub const IBV_PORT_IP_BASED_GIDS: u32 = 1 << 26;
// IBV_LINK_LAYER_ETHERNET
pub const IBV_LINK_LAYER_ETHERNET: u8 = 2;
// enum ibv_gid_type (ibv_gid_entry) and the sysfs one of ibv_query_gid_type (driver.h)
pub const IBV_GID_TYPE_ROCE_V2: u32 = 2;
pub const IBV_GID_TYPE_SYSFS_ROCE_V2: c_int = 1;
// enum ibv_qp_type
pub const IBV_QPT_RC: c_int = 2;
// enum ibv_qp_state
pub const IBV_QPS_RESET: c_int = 0;
pub const IBV_QPS_INIT: c_int = 1;
pub const IBV_QPS_RTR: c_int = 2;
pub const IBV_QPS_RTS: c_int = 3;
pub const IBV_QPS_SQD: c_int = 4;
pub const IBV_QPS_SQE: c_int = 5;
pub const IBV_QPS_ERR: c_int = 6;
// enum ibv_qp_attr_mask
pub const IBV_QP_STATE: c_int = 1;
pub const IBV_QP_ACCESS_FLAGS: c_int = 1 << 3;
pub const IBV_QP_PORT: c_int = 1 << 5;
pub const IBV_QP_AV: c_int = 1 << 7;
pub const IBV_QP_PATH_MTU: c_int = 1 << 8;
pub const IBV_QP_TIMEOUT: c_int = 1 << 9;
pub const IBV_QP_RETRY_CNT: c_int = 1 << 10;
pub const IBV_QP_RNR_RETRY: c_int = 1 << 11;
pub const IBV_QP_RQ_PSN: c_int = 1 << 12;
pub const IBV_QP_MIN_RNR_TIMER: c_int = 1 << 15;
pub const IBV_QP_SQ_PSN: c_int = 1 << 16;
pub const IBV_QP_CAP: c_int = 1 << 19;
pub const IBV_QP_DEST_QPN: c_int = 1 << 20;
// enum ibv_wr_opcode
pub const IBV_WR_RDMA_WRITE: c_int = 0;
pub const IBV_WR_RDMA_WRITE_WITH_IMM: c_int = 1;
pub const IBV_WR_SEND: c_int = 2;
pub const IBV_WR_SEND_WITH_IMM: c_int = 3;
pub const IBV_WR_RDMA_READ: c_int = 4;
pub const IBV_WR_ATOMIC_CMP_AND_SWP: c_int = 5;
pub const IBV_WR_ATOMIC_FETCH_AND_ADD: c_int = 6;
// enum ibv_send_flags
pub const IBV_SEND_SIGNALED: c_uint = 1 << 1;
pub const IBV_SEND_INLINE: c_uint = 1 << 3;
// enum ibv_wc_status
pub const IBV_WC_SUCCESS: c_int = 0;
pub const IBV_WC_LOC_LEN_ERR: c_int = 1;
pub const IBV_WC_LOC_PROT_ERR: c_int = 4;
pub const IBV_WC_WR_FLUSH_ERR: c_int = 5;
pub const IBV_WC_REM_INV_REQ_ERR: c_int = 9;
pub const IBV_WC_REM_ACCESS_ERR: c_int = 10;
pub const IBV_WC_REM_OP_ERR: c_int = 11;
pub const IBV_WC_RETRY_EXC_ERR: c_int = 12;
pub const IBV_WC_RNR_RETRY_EXC_ERR: c_int = 13;
pub const IBV_WC_GENERAL_ERR: c_int = 21;
// enum ibv_wc_opcode
pub const IBV_WC_SEND: c_int = 0;
pub const IBV_WC_RDMA_WRITE: c_int = 1;
pub const IBV_WC_RDMA_READ: c_int = 2;
pub const IBV_WC_COMP_SWAP: c_int = 3;
pub const IBV_WC_FETCH_ADD: c_int = 4;
pub const IBV_WC_RECV: c_int = 1 << 7;
pub const IBV_WC_RECV_RDMA_WITH_IMM: c_int = (1 << 7) + 1;
// enum ibv_wc_flags
pub const IBV_WC_WITH_IMM: c_uint = 1 << 1;
// enum ibv_access_flags
pub const IBV_ACCESS_LOCAL_WRITE: c_int = 1;
pub const IBV_ACCESS_REMOTE_WRITE: c_int = 1 << 1;
pub const IBV_ACCESS_REMOTE_READ: c_int = 1 << 2;
pub const IBV_ACCESS_REMOTE_ATOMIC: c_int = 1 << 3;
pub const IBV_ACCESS_HUGETLB: c_int = 1 << 7;
/// `IBV_ACCESS_OPTIONAL_RANGE`: hints a device may ignore (relaxed ordering, ...).
pub const IBV_ACCESS_OPTIONAL_RANGE: c_int = ((1 << 30) - 1) & !((1 << 20) - 1);

/// `(C expression, value this crate uses)` pairs that must agree with the system's `verbs.h`.
pub fn layout_checks() -> Vec<(String, usize)> {
    use std::mem::{offset_of, size_of};
    let mut v: Vec<(String, usize)> = Vec::new();
    macro_rules! size {
        ($t:ident) => {
            v.push((
                format!("sizeof(struct {})", stringify!($t)),
                size_of::<$t>(),
            ));
        };
    }
    macro_rules! off {
        ($t:ident, $($f:ident).+) => {
            v.push((
                format!("offsetof(struct {}, {})", stringify!($t), stringify!($($f).+)),
                offset_of!($t, $($f).+),
            ));
        };
    }
    macro_rules! konst {
        ($($c:ident),+) => {
            $(v.push((format!("(size_t){}", stringify!($c)), $c as usize));)+
        };
    }
    size!(ibv_device);
    off!(ibv_device, node_type);
    off!(ibv_device, transport_type);
    off!(ibv_device, name);
    off!(ibv_device, dev_name);
    off!(ibv_device, dev_path);
    off!(ibv_device, ibdev_path);
    size!(ibv_context_ops);
    off!(ibv_context_ops, poll_cq);
    off!(ibv_context_ops, req_notify_cq);
    off!(ibv_context_ops, post_srq_recv);
    off!(ibv_context_ops, post_send);
    off!(ibv_context_ops, post_recv);
    size!(ibv_context);
    off!(ibv_context, ops);
    off!(ibv_context, cmd_fd);
    off!(ibv_context, async_fd);
    off!(ibv_context, num_comp_vectors);
    off!(ibv_context, mutex);
    off!(ibv_context, abi_compat);
    size!(verbs_context);
    off!(verbs_context, query_port);
    off!(verbs_context, sz);
    off!(verbs_context, context);
    size!(ibv_device_attr);
    off!(ibv_device_attr, node_guid);
    off!(ibv_device_attr, vendor_id);
    off!(ibv_device_attr, max_qp_rd_atom);
    off!(ibv_device_attr, atomic_cap);
    off!(ibv_device_attr, max_srq_sge);
    off!(ibv_device_attr, max_pkeys);
    off!(ibv_device_attr, phys_port_cnt);
    size!(ibv_port_attr);
    off!(ibv_port_attr, max_msg_sz);
    off!(ibv_port_attr, pkey_tbl_len);
    off!(ibv_port_attr, active_width);
    off!(ibv_port_attr, link_layer);
    off!(ibv_port_attr, flags);
    off!(ibv_port_attr, port_cap_flags2);
    size!(ibv_gid_entry);
    off!(ibv_gid_entry, gid_type);
    off!(ibv_gid_entry, ndev_ifindex);
    size!(ibv_pd);
    size!(ibv_mr);
    off!(ibv_mr, addr);
    off!(ibv_mr, length);
    off!(ibv_mr, lkey);
    off!(ibv_mr, rkey);
    size!(ibv_comp_channel);
    size!(ibv_cq);
    off!(ibv_cq, cqe);
    off!(ibv_cq, mutex);
    off!(ibv_cq, cond);
    off!(ibv_cq, comp_events_completed);
    size!(ibv_qp);
    off!(ibv_qp, send_cq);
    off!(ibv_qp, recv_cq);
    off!(ibv_qp, srq);
    off!(ibv_qp, qp_num);
    off!(ibv_qp, state);
    off!(ibv_qp, qp_type);
    off!(ibv_qp, mutex);
    off!(ibv_qp, events_completed);
    size!(ibv_qp_cap);
    size!(ibv_qp_init_attr);
    off!(ibv_qp_init_attr, cap);
    off!(ibv_qp_init_attr, qp_type);
    off!(ibv_qp_init_attr, sq_sig_all);
    size!(ibv_global_route);
    off!(ibv_global_route, sgid_index);
    off!(ibv_global_route, hop_limit);
    size!(ibv_ah_attr);
    off!(ibv_ah_attr, dlid);
    off!(ibv_ah_attr, is_global);
    off!(ibv_ah_attr, port_num);
    size!(ibv_qp_attr);
    off!(ibv_qp_attr, dest_qp_num);
    off!(ibv_qp_attr, qp_access_flags);
    off!(ibv_qp_attr, cap);
    off!(ibv_qp_attr, ah_attr);
    off!(ibv_qp_attr, alt_ah_attr);
    off!(ibv_qp_attr, pkey_index);
    off!(ibv_qp_attr, max_rd_atomic);
    off!(ibv_qp_attr, port_num);
    off!(ibv_qp_attr, rnr_retry);
    off!(ibv_qp_attr, rate_limit);
    size!(ibv_sge);
    size!(ibv_send_wr);
    off!(ibv_send_wr, sg_list);
    off!(ibv_send_wr, num_sge);
    off!(ibv_send_wr, opcode);
    off!(ibv_send_wr, send_flags);
    off!(ibv_send_wr, imm_data);
    off!(ibv_send_wr, wr.rdma.remote_addr);
    off!(ibv_send_wr, wr.rdma.rkey);
    off!(ibv_send_wr, wr.atomic.compare_add);
    off!(ibv_send_wr, wr.atomic.swap);
    off!(ibv_send_wr, wr.atomic.rkey);
    off!(ibv_send_wr, qp_type);
    size!(ibv_recv_wr);
    off!(ibv_recv_wr, num_sge);
    size!(ibv_wc);
    off!(ibv_wc, status);
    off!(ibv_wc, byte_len);
    off!(ibv_wc, imm_data);
    off!(ibv_wc, qp_num);
    off!(ibv_wc, src_qp);
    off!(ibv_wc, wc_flags);
    off!(ibv_wc, sl);
    size!(ibv_async_event);
    konst!(
        IBV_NODE_CA,
        IBV_TRANSPORT_IB,
        IBV_ATOMIC_HCA,
        IBV_MTU_1024,
        IBV_MTU_4096,
        IBV_PORT_DOWN,
        IBV_PORT_ACTIVE,
        IBV_PORT_IP_BASED_GIDS,
        IBV_LINK_LAYER_ETHERNET,
        IBV_GID_TYPE_ROCE_V2,
        IBV_QPT_RC,
        IBV_QPS_RESET,
        IBV_QPS_INIT,
        IBV_QPS_RTR,
        IBV_QPS_RTS,
        IBV_QPS_SQD,
        IBV_QPS_SQE,
        IBV_QPS_ERR,
        IBV_QP_STATE,
        IBV_QP_ACCESS_FLAGS,
        IBV_QP_PORT,
        IBV_QP_AV,
        IBV_QP_PATH_MTU,
        IBV_QP_TIMEOUT,
        IBV_QP_RETRY_CNT,
        IBV_QP_RNR_RETRY,
        IBV_QP_RQ_PSN,
        IBV_QP_MIN_RNR_TIMER,
        IBV_QP_SQ_PSN,
        IBV_QP_CAP,
        IBV_QP_DEST_QPN,
        IBV_WR_RDMA_WRITE,
        IBV_WR_RDMA_WRITE_WITH_IMM,
        IBV_WR_SEND,
        IBV_WR_SEND_WITH_IMM,
        IBV_WR_RDMA_READ,
        IBV_WR_ATOMIC_CMP_AND_SWP,
        IBV_WR_ATOMIC_FETCH_AND_ADD,
        IBV_SEND_SIGNALED,
        IBV_SEND_INLINE,
        IBV_WC_SUCCESS,
        IBV_WC_LOC_LEN_ERR,
        IBV_WC_LOC_PROT_ERR,
        IBV_WC_WR_FLUSH_ERR,
        IBV_WC_REM_INV_REQ_ERR,
        IBV_WC_REM_ACCESS_ERR,
        IBV_WC_REM_OP_ERR,
        IBV_WC_RETRY_EXC_ERR,
        IBV_WC_RNR_RETRY_EXC_ERR,
        IBV_WC_GENERAL_ERR,
        IBV_WC_SEND,
        IBV_WC_RDMA_WRITE,
        IBV_WC_RDMA_READ,
        IBV_WC_COMP_SWAP,
        IBV_WC_FETCH_ADD,
        IBV_WC_RECV,
        IBV_WC_RECV_RDMA_WITH_IMM,
        IBV_WC_WITH_IMM,
        IBV_ACCESS_LOCAL_WRITE,
        IBV_ACCESS_REMOTE_WRITE,
        IBV_ACCESS_REMOTE_READ,
        IBV_ACCESS_REMOTE_ATOMIC,
        IBV_ACCESS_HUGETLB,
        IBV_ACCESS_OPTIONAL_RANGE
    );
    v
}
