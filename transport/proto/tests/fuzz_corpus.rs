//! Replays the committed cargo-fuzz corpus (`fuzz/corpus/<target>/`) through the same entry
//! points the fuzz targets call, so every seed and every minimised crash input runs in plain
//! `cargo test` too. The ignored test `regenerate_seed_corpus` writes the seeds.

use std::fs;
use std::path::{Path, PathBuf};

use tbrdma_proto::fuzzing::{
    PATCH_ADDRESS, PATCH_CRC, decode_packet, describe_endpoint_script, feed_endpoint,
    record_endpoint_script,
};
use tbrdma_proto::seq::Psn;
use tbrdma_proto::wire::{
    self, ErrorCode, Ext, FLAG_ACK_REQUEST, FLAG_ACK_VALID, FLAG_DATA_DIGEST, FLAG_HAS_IMM,
    Handshake, Header, MAX_HEADER_LEN, NakCode, Remote, SackBlock, SackList, Segment,
};

fn corpus(target: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fuzz/corpus")
        .join(target)
}

fn files(target: &str) -> Vec<PathBuf> {
    let mut files: Vec<_> = fs::read_dir(corpus(target))
        .unwrap_or_else(|e| panic!("corpus of {target}: {e}"))
        .map(|entry| entry.expect("directory entry").path())
        .collect();
    files.sort();
    files
}

#[test]
fn decode_corpus_replays() {
    let files = files("decode");
    assert!(files.len() >= 20, "decode corpus has {} files", files.len());
    for file in files {
        let data = fs::read(&file).expect("corpus file");
        eprintln!("{}", file.display());
        decode_packet(&data);
        feed_endpoint(&data);
    }
}

#[test]
fn endpoint_corpus_replays() {
    let files = files("endpoint");
    assert!(
        files.len() >= 10,
        "endpoint corpus has {} files",
        files.len()
    );
    for file in files {
        let data = fs::read(&file).expect("corpus file");
        eprintln!("{}", file.display());
        feed_endpoint(&data);
        decode_packet(&data);
    }
}

/// One datagram of every opcode, with the payload lengths that opcode allows.
fn sample_datagrams() -> Vec<(&'static str, Vec<u8>)> {
    let header = |flags| Header {
        opcode: wire::Opcode::KeepAlive, // write_header takes the opcode from the extension.
        token: 0x1234_5678_9abc_def0,
        dest_qpn: 22,
        psn: Psn(u32::MAX - 1),
        ack_psn: Psn(5),
        flags,
    };
    let segment = |offset, msg_len| Segment {
        msg_first_psn: Psn(u32::MAX - 2),
        imm_or_req: 0xfeed,
        offset,
        msg_len,
    };
    let remote = Remote {
        rkey: 0xdead_beef,
        addr: 0x10_0000,
    };
    let handshake = Handshake {
        src_qpn: 11,
        initial_psn: Psn(77),
        max_payload: 1400,
        window: 64,
    };
    let mut sacks = SackList::default();
    sacks.push(SackBlock {
        start: Psn(7),
        end: Psn(9),
    });
    sacks.push(SackBlock {
        start: Psn(u32::MAX),
        end: Psn(3),
    });
    let valid = FLAG_ACK_VALID;
    let cases: Vec<(&'static str, u16, Ext, usize)> = vec![
        (
            "send",
            valid | FLAG_ACK_REQUEST,
            Ext::Send(segment(0, 5)),
            5,
        ),
        ("send_imm", FLAG_HAS_IMM, Ext::Send(segment(100, 164)), 64),
        ("send_empty", 0, Ext::Send(segment(0, 0)), 0),
        ("write", valid, Ext::Write(segment(8, 16), remote), 8),
        (
            "write_digest",
            valid | FLAG_DATA_DIGEST,
            Ext::Write(segment(8, 16), remote),
            8,
        ),
        (
            "write_imm",
            valid,
            Ext::WriteWithImm(segment(0, 3), remote),
            3,
        ),
        (
            "read_request",
            valid,
            Ext::ReadRequest { remote, len: 4096 },
            0,
        ),
        (
            "read_response",
            valid,
            Ext::ReadResponse(segment(0, 16)),
            16,
        ),
        ("fetch_add", valid, Ext::FetchAdd { remote, add: 1 }, 0),
        (
            "cmp_swap",
            valid,
            Ext::CmpSwap {
                remote,
                compare: 1,
                swap: 2,
            },
            0,
        ),
        (
            "atomic_response",
            valid,
            Ext::AtomicResponse {
                req_psn: Psn(3),
                original: 9,
            },
            0,
        ),
        (
            "fatal_nak",
            valid,
            Ext::FatalNak {
                req_psn: Psn(3),
                code: ErrorCode::RemoteAccess,
            },
            0,
        ),
        (
            "ack",
            valid,
            Ext::Ack {
                window: 32,
                receive_limit: 7,
                sacks: SackList::default(),
            },
            0,
        ),
        (
            "ack_sacks",
            valid,
            Ext::Ack {
                window: 32,
                receive_limit: 7,
                sacks,
            },
            0,
        ),
        (
            "nak_seq",
            valid,
            Ext::Nak {
                psn: Psn(4),
                code: NakCode::SequenceError,
                rnr_delay_us: 0,
            },
            0,
        ),
        (
            "nak_rnr",
            valid,
            Ext::Nak {
                psn: Psn(4),
                code: NakCode::ReceiverNotReady,
                rnr_delay_us: 100,
            },
            0,
        ),
        ("connect", 0, Ext::Connect(handshake), 0),
        (
            "connect_digest",
            FLAG_DATA_DIGEST,
            Ext::Connect(handshake),
            0,
        ),
        ("accept", 0, Ext::Accept(handshake), 0),
        ("close", 0, Ext::Close { reason: 0 }, 0),
        ("keepalive", valid, Ext::KeepAlive, 0),
    ];
    cases
        .into_iter()
        .map(|(name, flags, ext, payload_len)| {
            let mut buf = vec![0; MAX_HEADER_LEN + payload_len + 16 * 8];
            let len = wire::write_header(&mut buf, &header(flags), &ext, payload_len);
            for (i, byte) in buf[len..len + payload_len].iter_mut().enumerate() {
                *byte = i as u8;
            }
            buf.truncate(len + payload_len);
            wire::seal(&mut buf);
            (name, buf)
        })
        .collect()
}

/// Datagrams that must be rejected, one per check of the decoder.
fn garbage(valid: &[u8]) -> Vec<(&'static str, Vec<u8>)> {
    let mut bad_magic = valid.to_vec();
    bad_magic[0] = b'x';
    let mut bad_version = valid.to_vec();
    bad_version[2] = 2;
    let mut bad_crc = valid.to_vec();
    bad_crc[4] ^= 1;
    let resealed = |mut d: Vec<u8>| {
        wire::seal(&mut d);
        d
    };
    let mut unknown_opcode = valid.to_vec();
    unknown_opcode[3] = 0x0f;
    let mut unknown_flags = valid.to_vec();
    unknown_flags[28] |= 0x80;
    let mut long = valid.to_vec();
    long.push(0);
    vec![
        ("empty", Vec::new()),
        ("short", valid[..31].to_vec()),
        ("bad_magic", bad_magic),
        ("bad_version", bad_version),
        ("bad_crc", bad_crc),
        ("unknown_opcode", resealed(unknown_opcode)),
        ("unknown_flags", resealed(unknown_flags)),
        ("length_mismatch", resealed(long)),
        (
            "noise",
            (0..200u32)
                .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
                .collect(),
        ),
    ]
}

/// Action scripts (see `feed_endpoint`), to be recorded so real traffic becomes forged
/// datagrams the fuzzer can mutate. Side b is 0, a is 8 (bit 3).
fn endpoint_scripts() -> Vec<(&'static str, Vec<u8>)> {
    let deliver_all = 7u8;
    let a = 8u8;
    let advance = |t: u8| [5u8, t];
    let mut scripts: Vec<(&'static str, Vec<u8>)> = vec![("empty", Vec::new())];
    // The work posted at start-up, exchanged to the end.
    scripts.push(("exchange", vec![deliver_all; 24]));
    // Loss: drop the first datagrams each way, then let retransmission recover.
    let mut loss = vec![4, 4, a | 4, deliver_all, deliver_all];
    loss.extend(advance(5));
    loss.extend([deliver_all; 16]);
    loss.extend(advance(20));
    loss.extend([deliver_all; 16]);
    scripts.push(("loss", loss));
    // Reordering and duplication.
    let mut reorder = vec![0x20 | 4, 0x10 | 4, a | 0x20 | 4, deliver_all, deliver_all];
    reorder.extend([deliver_all; 16]);
    scripts.push(("reorder_duplicate", reorder));
    // More SENDs than b has receives: receiver-not-ready, then a receive is posted.
    let mut rnr = vec![deliver_all; 8];
    for i in 0..6 {
        rnr.extend([a | 6, 2 + 6 * i, 4]);
    }
    rnr.extend([deliver_all; 6]);
    rnr.extend([0x10 | 7, 100, 0x10 | 7, 100]);
    rnr.extend(advance(3));
    rnr.extend([deliver_all; 12]);
    scripts.push(("rnr", rnr));
    // A WRITE to the peer's read-only region: FATAL_NAK, both sides fail.
    let mut refused = vec![deliver_all; 8];
    refused.extend([a | 6, 6, 10]);
    refused.extend([deliver_all; 12]);
    scripts.push(("remote_access_refused", refused));
    // A WRITE to a deregistered region, and a misaligned atomic.
    let mut revoked = vec![deliver_all; 8];
    revoked.extend([6, 12, 3, 6, 0x80 | 4, 9]);
    revoked.extend([deliver_all; 12]);
    scripts.push(("revoked_and_misaligned", revoked));
    // Every operation again, mid-stream, with corruption on the way.
    let mut mixed = vec![deliver_all; 6];
    for kind in 0..6 {
        mixed.extend([6, kind, 20 + kind, a | 6, kind, 40]);
    }
    mixed.extend([3, 40, 1, 0x20 | 3, 50, 4, a | 3, 7, 7]);
    mixed.extend([deliver_all; 20]);
    scripts.push(("mixed_corrupt", mixed));
    // Idle long enough for keep-alives, then long enough to time out.
    let mut idle = vec![deliver_all; 24];
    idle.extend(advance(110));
    idle.extend([deliver_all; 4]);
    idle.extend(advance(255));
    idle.extend(advance(255));
    scripts.push(("keepalive_idle", idle));
    // The application closes one side.
    let mut close = vec![deliver_all; 4];
    close.push(0x20 | 7);
    close.extend([deliver_all; 6]);
    scripts.push(("close", close));
    // The peer goes silent with work outstanding.
    let mut silent = vec![deliver_all; 2];
    for _ in 0..12 {
        silent.extend([4, a | 4]);
        silent.extend(advance(40));
    }
    scripts.push(("peer_silent", silent));
    scripts
}

/// The seeds are only useful if recording keeps the traffic: a recorded script must take the
/// pair exactly where the original took it, and the exchange must get work done.
#[test]
fn recorded_scripts_replay_the_same_traffic() {
    for (name, script) in endpoint_scripts() {
        let recorded = record_endpoint_script(&script);
        let original = describe_endpoint_script(&script);
        assert_eq!(
            original,
            describe_endpoint_script(&recorded),
            "script {name}"
        );
        if name == "exchange" {
            eprintln!("{original}");
            assert!(original.contains("Established"), "{original}");
            assert!(!original.contains(" 0 completed"), "{original}");
        }
    }
}

/// Wraps a sample datagram as a one-action endpoint script (forged, address and CRC patched).
fn forged(datagram: &[u8]) -> Vec<u8> {
    let len = datagram.len() as u16;
    let mut script = vec![(PATCH_ADDRESS | PATCH_CRC) << 4];
    script.extend(len.to_le_bytes());
    script.extend(datagram);
    script
}

/// Rewrites the seed corpus: `cargo test -p tbrdma-proto --test fuzz_corpus -- --ignored`.
/// Files the fuzzer or a person added (minimised crashes: `crash-*`) are kept.
#[test]
#[ignore = "rewrites fuzz/corpus; run by hand after changing the wire format or the harness"]
fn regenerate_seed_corpus() {
    let write = |target: &str, name: &str, data: &[u8]| {
        let dir = corpus(target);
        fs::create_dir_all(&dir).expect("corpus directory");
        fs::write(dir.join(format!("seed-{name}")), data).expect("write seed");
    };
    for target in ["decode", "endpoint"] {
        for file in fs::read_dir(corpus(target)).into_iter().flatten() {
            let path = file.expect("entry").path();
            if path
                .file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("seed-"))
            {
                fs::remove_file(path).expect("remove old seed");
            }
        }
    }
    let samples = sample_datagrams();
    for (name, datagram) in &samples {
        write("decode", name, datagram);
        write("endpoint", &format!("forged-{name}"), &forged(datagram));
    }
    for (name, datagram) in garbage(&samples[0].1) {
        write("decode", &format!("garbage-{name}"), &datagram);
    }
    for (name, script) in endpoint_scripts() {
        write("endpoint", name, &record_endpoint_script(&script));
    }
}
