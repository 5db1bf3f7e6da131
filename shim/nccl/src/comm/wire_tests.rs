//! The protocol end to end over a real queue pair (127.0.0.1, caller progress), driven from
//! one thread by random schedules of posts and tests: sends and receives posted in any order
//! and far ahead of each other, requests tested in any order, sizes from 0 B to 64 KiB around
//! the eager limit, some receives too small.

use std::sync::Mutex;
use std::time::{Duration, Instant};

use tbrdma_verbs::{
    Access, Device, DeviceConfig, EngineConfig, Listener, Progress, ProtectionDomain, QpOptions,
};

use super::{
    CQ_CAPACITY, EAGER_MAX, Link, NCCL_NET_MAX_REQUESTS, RecvComm, Registration, Registrations,
    SendComm,
};
use crate::error::NetError;

/// Buffer of one outstanding request.
const SLOT: u64 = 64 << 10;
const SLOTS: usize = NCCL_NET_MAX_REQUESTS;

/// A caller-progress device on 127.0.0.1 and a thread accepting one connection on it into a
/// receive comm (named `peer` in its errors): the device, its protection domain, the address
/// to connect to and the thread.
pub(super) fn receiver_on_loopback(
    peer: &'static str,
) -> (
    Device,
    ProtectionDomain,
    std::net::SocketAddr,
    std::thread::JoinHandle<RecvComm>,
) {
    let config = DeviceConfig {
        engine: EngineConfig {
            progress: Progress::Caller,
            ..Default::default()
        },
        port: 0,
    };
    let dev = Device::open("127.0.0.1", config).expect("device");
    let pd = dev.alloc_pd();
    let listener = Listener::bind(&dev, 0).expect("listen");
    let server = listener.local_addr().expect("listening address");
    let (rpd, rcq) = (pd.clone(), dev.create_cq(CQ_CAPACITY));
    let acceptor = std::thread::spawn(move || {
        let wait = Some(Duration::from_secs(10));
        let c = listener
            .accept(&rpd, &rcq, &rcq, &QpOptions::default(), wait)
            .expect("accept");
        let link = Link {
            qp: c.qp,
            cq: rcq,
            pd: rpd,
            peer: peer.into(),
        };
        RecvComm::new(link).expect("receive comm")
    });
    (dev, pd, server, acceptor)
}

fn pair() -> (SendComm, RecvComm) {
    let (dev, pd, server, acceptor) = receiver_on_loopback("receiver");
    let scq = dev.create_cq(CQ_CAPACITY);
    let c = tbrdma_verbs::connect(&pd, server, &scq, &scq, &QpOptions::default()).expect("connect");
    let link = Link {
        qp: c.qp,
        cq: scq,
        pd,
        peer: "sender".into(),
    };
    let send = SendComm::new(link).expect("send comm");
    (send, acceptor.join().expect("acceptor"))
}

/// Registers `SLOTS` request buffers on a comm; returns the handle and the first address.
fn register(pd: &ProtectionDomain, regs: &Mutex<Registrations>) -> (u64, u64) {
    let len = SLOTS as u64 * SLOT;
    let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
    let mr = pd.alloc_mr(len as usize, access).expect("region");
    let addr = mr.addr();
    let handle = regs.lock().unwrap().insert(Registration { addr, len, mr });
    (handle, addr)
}

fn byte(message: usize, at: u64) -> u8 {
    ((message as u64).wrapping_mul(0x9e37) ^ at.wrapping_mul(31)) as u8
}

/// Message `i`: its size (at most `max`) and the capacity of its receive.
fn plan(next: &mut impl FnMut() -> u64, messages: usize, max: u64) -> Vec<(u64, u64)> {
    (0..messages)
        .map(|_| {
            let size = match next() % 8 {
                0 => 0,
                1 => next() % 64,
                2 | 3 => next() % (EAGER_MAX + 1),
                4 => EAGER_MAX - 1 + next() % 3,
                _ => 1 + next() % SLOT,
            }
            .min(max);
            let capacity = if size > 0 && next() % 16 == 0 {
                next() % size
            } else if next() % 2 == 0 {
                SLOT
            } else {
                size + next() % (SLOT - size + 1)
            };
            (size, capacity)
        })
        .collect()
}

fn run(seed: u64, messages: usize, max: u64) {
    let (send, recv) = pair();
    let (sh, saddr) = register(send.pd(), &send.regs);
    let (rh, raddr) = register(recv.pd(), &recv.regs);
    let mut rng = seed.wrapping_mul(0x2545_f491_4f6c_dd1d) | 1;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    let plan = plan(&mut next, messages, max);
    let (mut send_bufs, mut recv_bufs): (Vec<usize>, Vec<usize>) =
        ((0..SLOTS).collect(), (0..SLOTS).collect());
    // Outstanding requests: (message, request slot, buffer).
    let (mut sends, mut recvs) = (Vec::new(), Vec::new());
    let (mut posted_sends, mut posted_recvs, mut done_sends, mut done_recvs) = (0, 0, 0, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut step = 0u64;
    while done_sends < messages || done_recvs < messages {
        assert!(
            Instant::now() < deadline,
            "seed {seed}: stuck at {done_sends} sends and {done_recvs} receives done \
             ({posted_sends} and {posted_recvs} posted)"
        );
        step += 1;
        // Phases that favour one side, so that each runs far ahead of the other.
        let bias = (step / 300) % 3;
        let op = next() % 6;
        let op = match (bias, op) {
            (1, 4 | 5) => 0,
            (2, 4 | 5) => 1,
            (_, 4 | 5) => 2 + next() % 2,
            (_, op) => op,
        };
        match op {
            0 if posted_sends < messages && !send_bufs.is_empty() => {
                let (size, _) = plan[posted_sends];
                let buf = send_bufs.pop().unwrap();
                let at = buf as u64 * SLOT;
                let data: Vec<u8> = (0..size).map(|k| byte(posted_sends, k)).collect();
                send.regs.lock().unwrap().map[&sh]
                    .mr
                    .write(at as usize, &data);
                match send.isend(saddr + at, size, sh).expect("isend") {
                    Some(slot) => {
                        sends.push((posted_sends, slot, buf));
                        posted_sends += 1;
                    }
                    None => send_bufs.push(buf),
                }
            }
            1 if posted_recvs < messages && !recv_bufs.is_empty() => {
                let (_, capacity) = plan[posted_recvs];
                let buf = recv_bufs.pop().unwrap();
                let at = raddr + buf as u64 * SLOT;
                match recv.irecv(at, capacity, rh).expect("irecv") {
                    Some(slot) => {
                        recvs.push((posted_recvs, slot, buf));
                        posted_recvs += 1;
                    }
                    None => recv_bufs.push(buf),
                }
            }
            2 if !sends.is_empty() => {
                let pick = (next() % sends.len() as u64) as usize;
                let (i, slot, buf) = sends[pick];
                let (size, capacity) = plan[i];
                let finished = match send.test(slot) {
                    Ok(None) => false,
                    Ok(Some(len)) => {
                        assert_eq!(len, size, "seed {seed}: send {i} size");
                        true
                    }
                    Err(NetError::Truncated { .. }) => {
                        assert!(capacity < size, "seed {seed}: send {i} refused");
                        true
                    }
                    Err(e) => panic!("seed {seed}: send {i}: {e}"),
                };
                if finished {
                    sends.swap_remove(pick);
                    send_bufs.push(buf);
                    done_sends += 1;
                }
            }
            3 if !recvs.is_empty() => {
                let pick = (next() % recvs.len() as u64) as usize;
                let (i, slot, buf) = recvs[pick];
                let (size, capacity) = plan[i];
                let finished = match recv.test(slot) {
                    Ok(None) => false,
                    Ok(Some(len)) => {
                        assert!(capacity >= size, "seed {seed}: receive {i} not refused");
                        assert_eq!(len, size, "seed {seed}: receive {i} size");
                        let mut got = vec![0u8; size as usize];
                        let at = buf as u64 * SLOT;
                        recv.regs.lock().unwrap().map[&rh]
                            .mr
                            .read(at as usize, &mut got);
                        let want: Vec<u8> = (0..size).map(|k| byte(i, k)).collect();
                        assert!(got == want, "seed {seed}: receive {i} data differs");
                        true
                    }
                    Err(NetError::Truncated { .. }) => {
                        assert!(capacity < size, "seed {seed}: receive {i} refused");
                        true
                    }
                    Err(e) => panic!("seed {seed}: receive {i}: {e}"),
                };
                if finished {
                    recvs.swap_remove(pick);
                    recv_bufs.push(buf);
                    done_recvs += 1;
                }
            }
            _ => {}
        }
    }
    assert!(send.settled());
    assert!(recv.settled());
}

#[test]
fn random_schedules_deliver_every_message_in_order() {
    for seed in 1..=8 {
        run(seed, 500, SLOT);
    }
}

/// No rendezvous, hence no CTS to carry credits back: only the credit messages do.
#[test]
fn eager_only_schedules_get_their_credits_back() {
    for seed in 11..=14 {
        run(seed, 500, EAGER_MAX);
    }
}
