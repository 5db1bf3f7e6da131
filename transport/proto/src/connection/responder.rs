//! The responder: what a packet does once the receive stream (`rx.rs`) has accepted it, in
//! order. For the peer's requests it checks keys, bounds and receive buffers before any byte
//! moves, places SEND and WRITE data, queues READ responses, runs atomics exactly once, and
//! refuses what can never succeed (a FATAL_NAK, sequenced behind every response already
//! queued, and the connection drains) or cannot succeed yet (a receiver-not-ready NAK). For the
//! peer's responses to this side's requests it lands READ data and atomic results in the
//! requests' local buffers and fails the connection at a request the peer refused. It
//! completes receives; the send queue completes the rest.
//!
//! Ownership: the receive stream owns acceptance, ordering and the message in progress; this
//! module owns where each message goes ([`InTarget`]) and what it leaves behind.

use super::Connection;
use super::ConnectionError;
use super::ConnectionState;
use super::tx::OutKind;
use crate::memory::{Access, Memory, Placement};
use crate::seq::Psn;
use crate::wire::{ErrorCode, Ext, FLAG_HAS_IMM, Packet, Segment};
use crate::work::{Queue, SendOp, WcOpcode, WcStatus, WorkCompletion};

/// Where the packets of the message being received go.
#[derive(Clone, Copy, Debug)]
pub(super) enum InTarget {
    /// A SEND into a posted receive.
    Recv {
        wr_id: u64,
        placement: Option<Placement>,
        imm: Option<u32>,
    },
    /// A WRITE, with the receive it consumed for WRITE_WITH_IMM.
    Write {
        placement: Option<Placement>,
        recv: Option<(u64, u32)>,
    },
    /// The data answering our READ whose request started at `req_psn`.
    ReadResponse {
        placement: Option<Placement>,
        req_psn: Psn,
    },
}

impl InTarget {
    /// Where the message's bytes go (`None` for an empty message).
    pub fn placement(&self) -> Option<Placement> {
        match *self {
            InTarget::Recv { placement, .. }
            | InTarget::Write { placement, .. }
            | InTarget::ReadResponse { placement, .. } => placement,
        }
    }
}

/// Why the responder will not take a message now.
enum Refusal {
    /// No receive posted: ask the sender to retry later.
    NotReady,
    /// The request can never succeed: the connection ends.
    Fatal(ErrorCode),
    /// The packet contradicts the protocol; drop it as if corrupted.
    Malformed,
}

impl Connection {
    /// Where the new message `packet` (one of its packets, `seg` its segment) belongs to goes,
    /// or `None` when it is refused: a receiver-not-ready NAK (sent for the message's first
    /// packet only), a dropped malformed packet, or a refusal that ends the connection.
    pub(super) fn begin_message<M: Memory + ?Sized>(
        &mut self,
        packet: &Packet<'_>,
        seg: &Segment,
        mem: &M,
    ) -> Option<InTarget> {
        let psn = packet.header.psn;
        match self.message_target(packet, seg, mem) {
            Ok(target) => Some(target),
            Err(Refusal::NotReady) => {
                if psn == seg.msg_first_psn {
                    self.stats.rnr_naks_sent += 1;
                    self.rx.nak_not_ready(psn, self.config.rnr_delay);
                }
                None
            }
            Err(Refusal::Malformed) => {
                self.stats.malformed += 1;
                None
            }
            Err(Refusal::Fatal(code)) => {
                self.refuse(seg.msg_first_psn, code);
                None
            }
        }
    }

    /// Whether a later packet of the message in progress, going to `target`, may still be
    /// placed. The region may have been deregistered since the message began: check again, so
    /// a revoked region never receives another byte (the request is refused if not).
    pub(super) fn still_permitted<M: Memory + ?Sized>(
        &mut self,
        target: &InTarget,
        ext: &Ext,
        seg: &Segment,
        mem: &M,
    ) -> bool {
        if let (Ext::Write(_, remote) | Ext::WriteWithImm(_, remote), Some(_)) =
            (ext, target.placement())
        {
            if mem
                .table()
                .check_remote(remote.rkey, remote.addr, seg.msg_len, Access::REMOTE_WRITE)
                .is_err()
            {
                self.refuse(seg.msg_first_psn, ErrorCode::RemoteAccess);
                return false;
            }
        }
        true
    }

    /// Places one packet's payload, at `offset` in its message of `message_len` bytes, where
    /// the message goes.
    pub(super) fn place<M: Memory + ?Sized>(
        target: &InTarget,
        offset: u64,
        payload: &[u8],
        message_len: u64,
        mem: &mut M,
    ) {
        let Some(p) = target.placement() else {
            return;
        };
        if payload.is_empty() {
            return;
        }
        match target {
            InTarget::Write { .. } => {
                mem.place_write(p.region, p.offset + offset, payload, message_len);
            }
            InTarget::Recv { .. } | InTarget::ReadResponse { .. } => {
                mem.write(p.region, p.offset + offset, payload);
            }
        }
    }

    /// Takes the oldest posted receive for the next receive-consuming message, counting it for
    /// the receive credit this side reports (`credit.rs`).
    fn take_receive(&mut self) -> Option<crate::work::RecvWr> {
        let recv = self.rq.pop_front()?;
        self.receives_taken.took_one();
        Some(recv)
    }

    /// Decides where a new message goes, checking keys, bounds and receive buffers before any
    /// byte of it is placed.
    fn message_target<M: Memory + ?Sized>(
        &mut self,
        packet: &Packet<'_>,
        seg: &Segment,
        mem: &M,
    ) -> Result<InTarget, Refusal> {
        let (flags, ext) = (packet.header.flags, &packet.ext);
        self.rx.last_started_send = matches!(ext, Ext::Send(_));
        let len = seg.msg_len;
        match *ext {
            Ext::Send(_) => {
                let recv = *self.rq.front().ok_or(Refusal::NotReady)?;
                let imm = (flags & FLAG_HAS_IMM != 0).then_some(seg.imm_or_req);
                if len > recv.local.len {
                    self.take_receive();
                    self.push_recv_completion(
                        recv.wr_id,
                        WcStatus::LocalLength,
                        WcOpcode::Recv,
                        0,
                        None,
                    );
                    return Err(Refusal::Fatal(ErrorCode::InvalidRequest));
                }
                let placement = if len == 0 {
                    None
                } else {
                    match mem.table().check_local(
                        recv.local.lkey,
                        recv.local.addr,
                        len,
                        Access::LOCAL_WRITE,
                    ) {
                        Ok(p) => Some(p),
                        Err(_) => {
                            self.take_receive();
                            self.push_recv_completion(
                                recv.wr_id,
                                WcStatus::LocalProtection,
                                WcOpcode::Recv,
                                0,
                                None,
                            );
                            return Err(Refusal::Fatal(ErrorCode::RemoteOperational));
                        }
                    }
                };
                self.take_receive();
                Ok(InTarget::Recv {
                    wr_id: recv.wr_id,
                    placement,
                    imm,
                })
            }
            Ext::Write(_, remote) | Ext::WriteWithImm(_, remote) => {
                let placement = if len == 0 {
                    None
                } else {
                    let p = mem
                        .table()
                        .check_remote(remote.rkey, remote.addr, len, Access::REMOTE_WRITE)
                        .map_err(|_| Refusal::Fatal(ErrorCode::RemoteAccess))?;
                    Some(p)
                };
                let recv = if matches!(ext, Ext::WriteWithImm(..)) {
                    let recv = self.take_receive().ok_or(Refusal::NotReady)?;
                    Some((recv.wr_id, seg.imm_or_req))
                } else {
                    None
                };
                Ok(InTarget::Write { placement, recv })
            }
            Ext::ReadResponse(_) => {
                let req_psn = Psn(seg.imm_or_req);
                let entry = self.sq.by_first_psn(req_psn).ok_or(Refusal::Malformed)?;
                if !matches!(entry.wr.op, SendOp::Read { .. })
                    || entry.wr.local.len != len
                    || entry.responded
                {
                    return Err(Refusal::Malformed);
                }
                Ok(InTarget::ReadResponse {
                    placement: entry.local,
                    req_psn,
                })
            }
            _ => Err(Refusal::Malformed),
        }
    }

    /// Every packet of a message arrived: complete what it was for.
    /// Completes a message whose last packet was placed; `crc` is its CRC-32C when the
    /// connection builds them (`Config::message_crc`).
    pub(super) fn complete_message(&mut self, target: InTarget, msg_len: u64, crc: Option<u32>) {
        let (wr_id, opcode, imm) = match target {
            InTarget::Recv { wr_id, imm, .. } => (wr_id, WcOpcode::Recv, imm),
            InTarget::Write {
                recv: Some((wr_id, imm)),
                ..
            } => (wr_id, WcOpcode::RecvRdmaWithImm, Some(imm)),
            InTarget::Write { recv: None, .. } => return,
            InTarget::ReadResponse { req_psn, .. } => {
                if let Some(entry) = self.sq.by_first_psn(req_psn) {
                    entry.responded = true;
                }
                return;
            }
        };
        self.completions.push_back(WorkCompletion {
            wr_id,
            queue: Queue::Recv,
            status: WcStatus::Success,
            opcode,
            byte_len: msg_len,
            imm,
            payload_crc: crc,
        });
    }

    pub(super) fn push_recv_completion(
        &mut self,
        wr_id: u64,
        status: WcStatus,
        opcode: WcOpcode,
        byte_len: u64,
        imm: Option<u32>,
    ) {
        self.completions.push_back(WorkCompletion {
            wr_id,
            queue: Queue::Recv,
            status,
            opcode,
            byte_len,
            imm,
            payload_crc: None,
        });
    }

    /// Executes a single-packet request or response that carries no payload (READ request,
    /// atomics and their response, FATAL_NAK). Returns whether it was accepted; the receive
    /// stream then moves past it.
    pub(super) fn execute_single<M: Memory + ?Sized>(
        &mut self,
        packet: &Packet<'_>,
        mem: &mut M,
    ) -> bool {
        let (psn, ext) = (packet.header.psn, &packet.ext);
        let max_payload = self.max_payload;
        match *ext {
            Ext::ReadRequest { remote, len } => {
                let source = if len == 0 {
                    None
                } else {
                    match mem.table().check_remote(
                        remote.rkey,
                        remote.addr,
                        len,
                        Access::REMOTE_READ,
                    ) {
                        Ok(p) => Some(p),
                        Err(_) => {
                            self.refuse(psn, ErrorCode::RemoteAccess);
                            return false;
                        }
                    }
                };
                self.tx.push_response(
                    OutKind::ReadResponse {
                        source,
                        len,
                        req_psn: psn,
                    },
                    max_payload,
                );
            }
            Ext::FetchAdd { remote, .. } | Ext::CmpSwap { remote, .. } => {
                if remote.addr % 8 != 0 {
                    self.refuse(psn, ErrorCode::InvalidRequest);
                    return false;
                }
                let target = match mem.table().check_remote(
                    remote.rkey,
                    remote.addr,
                    8,
                    Access::REMOTE_ATOMIC,
                ) {
                    Ok(p) => p,
                    Err(_) => {
                        self.refuse(psn, ErrorCode::RemoteAccess);
                        return false;
                    }
                };
                let mut bytes = [0u8; 8];
                mem.read(target.region, target.offset, &mut bytes);
                let original = u64::from_le_bytes(bytes);
                let new = match *ext {
                    Ext::FetchAdd { add, .. } => Some(original.wrapping_add(add)),
                    Ext::CmpSwap { compare, swap, .. } => (original == compare).then_some(swap),
                    _ => None,
                };
                if let Some(new) = new {
                    mem.write(target.region, target.offset, &new.to_le_bytes());
                }
                self.tx.push_response(
                    OutKind::AtomicResponse {
                        req_psn: psn,
                        original,
                    },
                    max_payload,
                );
            }
            Ext::AtomicResponse { req_psn, original } => {
                let Some(entry) = self.sq.by_first_psn(req_psn) else {
                    self.stats.malformed += 1;
                    return false;
                };
                if !matches!(
                    entry.wr.op,
                    SendOp::FetchAdd { .. } | SendOp::CmpSwap { .. }
                ) || entry.responded
                {
                    self.stats.malformed += 1;
                    return false;
                }
                if let Some(local) = entry.local {
                    mem.write(local.region, local.offset, &original.to_le_bytes());
                }
                entry.responded = true;
            }
            Ext::FatalNak { req_psn, code } => {
                let status = match code {
                    ErrorCode::RemoteAccess => WcStatus::RemoteAccess,
                    ErrorCode::InvalidRequest => WcStatus::RemoteInvalidRequest,
                    ErrorCode::RemoteOperational => WcStatus::RemoteOperational,
                };
                // Everything before the refused request has completed by now (it was
                // acknowledged by this very packet); report it, then fail at the culprit.
                self.sq.mark_acked_before(req_psn);
                self.drain_send_queue();
                let culprit = self.sq.position_containing(req_psn);
                self.fail_at(culprit, status, ConnectionError::RequestRefused(status));
            }
            _ => {
                self.stats.malformed += 1;
                return false;
            }
        }
        true
    }

    /// Refuses the peer's request at `req_psn`: nothing of it was executed; a FATAL_NAK goes
    /// back in order behind every response already queued, and the connection drains.
    fn refuse(&mut self, req_psn: Psn, code: ErrorCode) {
        let max_payload = self.max_payload;
        self.tx
            .push_response(OutKind::FatalNak { req_psn, code }, max_payload);
        // A message in progress keeps the receive it consumed: it is flushed with the rest.
        if let Some(wr_id) = self.rx.consumed_receive() {
            self.push_recv_completion(wr_id, WcStatus::Flushed, WcOpcode::Recv, 0, None);
        }
        self.rx.abandon_message();
        self.refused = Some(code);
        self.state = ConnectionState::Draining;
        for wr in self.rq.drain(..) {
            self.completions.push_back(WorkCompletion {
                wr_id: wr.wr_id,
                queue: Queue::Recv,
                status: WcStatus::Flushed,
                opcode: WcOpcode::Recv,
                byte_len: 0,
                imm: None,
                payload_crc: None,
            });
        }
    }
}
