use proptest::prelude::*;

use super::*;

fn header(opcode: Opcode) -> Header {
    Header {
        opcode,
        token: 0x0123_4567_89ab_cdef,
        dest_qpn: 42,
        psn: Psn(1000),
        ack_psn: Psn(77),
        flags: FLAG_ACK_VALID,
    }
}

fn encode(ext: &Ext, payload: &[u8]) -> Vec<u8> {
    encode_with(ext, payload, 0)
}

/// As [`encode`], with `extra_flags` set in the common header.
fn encode_with(ext: &Ext, payload: &[u8], extra_flags: u16) -> Vec<u8> {
    let mut buf = vec![0u8; MAX_HEADER_LEN + 8 * MAX_SACK_BLOCKS + payload.len()];
    let mut h = header(ext.opcode());
    h.flags |= extra_flags;
    let n = write_header(&mut buf, &h, ext, payload.len());
    buf[n..n + payload.len()].copy_from_slice(payload);
    buf.truncate(n + payload.len());
    seal(&mut buf);
    buf
}

fn sample_exts() -> Vec<(Ext, Vec<u8>)> {
    let seg = Segment {
        msg_first_psn: Psn(990),
        imm_or_req: 5,
        offset: 16,
        msg_len: 20,
    };
    let remote = Remote {
        rkey: 0xdead_beef,
        addr: 0x7fff_0000_1000,
    };
    let mut sacks = SackList::default();
    sacks.push(SackBlock {
        start: Psn(80),
        end: Psn(90),
    });
    sacks.push(SackBlock {
        start: Psn(95),
        end: Psn(96),
    });
    vec![
        (Ext::Send(seg), vec![1, 2, 3, 4]),
        (Ext::Write(seg, remote), vec![9; 4]),
        (Ext::WriteWithImm(seg, remote), vec![]),
        (
            Ext::ReadRequest {
                remote,
                len: 1 << 33,
            },
            vec![],
        ),
        (Ext::ReadResponse(seg), vec![7; 4]),
        (Ext::FetchAdd { remote, add: 3 }, vec![]),
        (
            Ext::CmpSwap {
                remote,
                compare: 1,
                swap: 2,
            },
            vec![],
        ),
        (
            Ext::AtomicResponse {
                req_psn: Psn(5),
                original: u64::MAX,
            },
            vec![],
        ),
        (
            Ext::FatalNak {
                req_psn: Psn(6),
                code: ErrorCode::RemoteAccess,
            },
            vec![],
        ),
        (
            Ext::Ack {
                window: 256,
                receive_limit: 0xfffe_0003,
                sacks,
            },
            vec![],
        ),
        (
            Ext::Nak {
                psn: Psn(8),
                code: NakCode::ReceiverNotReady,
                rnr_delay_us: 100,
            },
            vec![],
        ),
        (
            Ext::Connect(Handshake {
                src_qpn: 3,
                initial_psn: Psn(u32::MAX),
                max_payload: 65420,
                window: 512,
            }),
            vec![],
        ),
        (
            Ext::Accept(Handshake {
                src_qpn: 4,
                initial_psn: Psn(0),
                max_payload: 1400,
                window: 64,
            }),
            vec![],
        ),
        (Ext::Close { reason: 0 }, vec![]),
        (Ext::KeepAlive, vec![]),
    ]
}

#[test]
fn every_opcode_round_trips() {
    for (ext, payload) in sample_exts() {
        let bytes = encode(&ext, &payload);
        let packet = decode(&bytes).unwrap_or_else(|e| panic!("{ext:?}: {e}"));
        assert_eq!(packet.ext, ext);
        assert_eq!(packet.header, header(ext.opcode()));
        assert_eq!(packet.payload, &payload[..]);
    }
}

#[test]
fn any_flipped_bit_is_rejected_except_in_a_payload_without_a_digest() {
    for (ext, payload) in sample_exts() {
        for digest in [0, FLAG_DATA_DIGEST] {
            let bytes = encode_with(&ext, &payload, digest);
            let header_len = bytes.len() - payload.len();
            for bit in 0..bytes.len() * 8 {
                let mut bad = bytes.clone();
                bad[bit / 8] ^= 1 << (bit % 8);
                let in_payload = bit / 8 >= header_len;
                if in_payload && digest == 0 && ext.opcode().carries_data() {
                    // Without a data digest the payload is the link's to vouch for.
                    let packet = decode(&bad).unwrap_or_else(|e| panic!("{ext:?}: {e}"));
                    assert_ne!(packet.payload, &payload[..]);
                } else {
                    assert!(
                        decode(&bad).is_err(),
                        "{ext:?}, flags {digest}: flipped bit {bit} accepted"
                    );
                }
            }
        }
    }
}

#[test]
fn truncation_and_extension_are_rejected() {
    for (ext, payload) in sample_exts() {
        let bytes = encode(&ext, &payload);
        for len in 0..bytes.len() {
            assert!(decode(&bytes[..len]).is_err());
        }
        let mut longer = bytes.clone();
        longer.push(0);
        seal(&mut longer);
        assert!(matches!(
            decode(&longer),
            Err(DecodeError::LengthMismatch { .. })
        ));
    }
}

#[test]
fn segment_past_message_end_is_rejected() {
    let seg = Segment {
        msg_first_psn: Psn(1),
        imm_or_req: 0,
        offset: 10,
        msg_len: 12,
    };
    let bytes = encode(&Ext::Send(seg), &[0; 3]);
    assert_eq!(
        decode(&bytes),
        Err(DecodeError::Malformed(
            "segment runs past the end of its message"
        ))
    );
}

#[test]
fn wrong_version_is_named() {
    let mut bytes = encode(&Ext::KeepAlive, &[]);
    bytes[2] = 9;
    seal(&mut bytes);
    assert_eq!(decode(&bytes), Err(DecodeError::UnsupportedVersion(9)));
}

proptest! {
    #[test]
    fn arbitrary_bytes_never_panic(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        let _ = decode(&bytes);
    }

    #[test]
    fn arbitrary_bytes_with_valid_crc_never_panic(mut bytes in proptest::collection::vec(any::<u8>(), 32..200), opcode in 0u8..0x30) {
        bytes[0..2].copy_from_slice(&MAGIC);
        bytes[2] = VERSION;
        bytes[3] = opcode;
        let len = (bytes.len() - COMMON_HEADER_LEN) as u16;
        bytes[30..32].copy_from_slice(&len.to_le_bytes());
        seal(&mut bytes);
        let _ = decode(&bytes);
    }
}

#[test]
fn a_crc_over_parts_equals_the_crc_of_the_whole() {
    let payload = (0..5000u32).map(|i| (i * 7 + 3) as u8).collect::<Vec<_>>();
    for (ext, _) in sample_exts() {
        if ext.segment().is_none() {
            continue;
        }
        for digest in [0, FLAG_DATA_DIGEST] {
            let mut head = vec![0u8; MAX_HEADER_LEN];
            let mut h = header(ext.opcode());
            h.flags |= digest;
            let n = write_header(&mut head, &h, &ext, payload.len());
            head.truncate(n);
            let mut whole = head.clone();
            whole.extend_from_slice(&payload);
            seal(&mut whole);
            // The payload fed as one piece, in several pieces, or partly inside the first part.
            for split in [0, 1, 17, 4096, payload.len()] {
                let mut first = head.clone();
                first.extend_from_slice(&payload[..split]);
                let rest = &payload[split..];
                seal_parts(&mut first, |feed| {
                    for piece in rest.chunks(1000) {
                        feed(piece);
                    }
                });
                assert_eq!(first[..], whole[..first.len()], "split {split}");
                assert_eq!(crc_of_parts(&first, |feed| feed(rest)), crc_of(&whole));
            }
            // The digest is what makes the CRC depend on the payload.
            let mut other = whole.clone();
            other[n] ^= 1;
            assert_eq!(crc_of(&other) == crc_of(&whole), digest == 0, "{ext:?}");
        }
    }
}

#[test]
fn peek_write_target_reads_what_write_header_wrote_and_nothing_else() {
    for (ext, payload) in sample_exts() {
        let datagram = encode(&ext, &payload);
        let peeked = peek_write_target(&datagram);
        match ext {
            Ext::Write(seg, remote) | Ext::WriteWithImm(seg, remote) => {
                let expected = WriteTarget {
                    dest_qpn: 42,
                    rkey: remote.rkey,
                    addr: remote.addr + seg.offset,
                    payload_len: payload.len(),
                };
                assert_eq!(peeked, Some(expected), "{ext:?}");
                // The first header bytes alone are enough; fewer are not.
                assert_eq!(
                    peek_write_target(&datagram[..MAX_HEADER_LEN]),
                    Some(expected)
                );
                assert_eq!(peek_write_target(&datagram[..MAX_HEADER_LEN - 1]), None);
                let mut bad = datagram.clone();
                bad[0] ^= 1;
                assert_eq!(peek_write_target(&bad), None, "bad magic");
            }
            _ => assert_eq!(peeked, None, "{ext:?} is not a write"),
        }
    }
}

#[test]
fn peek_send_start_finds_the_first_packet_of_a_send_and_nothing_else() {
    assert_eq!(SEND_HEADER_LEN, COMMON_HEADER_LEN + Opcode::Send.ext_len());
    for (ext, payload) in sample_exts() {
        for offset in [0, 16] {
            let mut ext = ext;
            if let Ext::Send(seg) | Ext::Write(seg, _) | Ext::WriteWithImm(seg, _) = &mut ext {
                seg.offset = offset;
                seg.msg_len = offset + payload.len() as u64;
            }
            let datagram = encode(&ext, &payload);
            let peeked = peek_send_start(&datagram);
            if matches!(ext, Ext::Send(_)) && offset == 0 {
                assert_eq!(peeked, Some((42, payload.len())), "{ext:?}");
                assert_eq!(peek_send_start(&datagram[..SEND_HEADER_LEN - 1]), None);
                let mut bad = datagram.clone();
                bad[2] ^= 1;
                assert_eq!(peek_send_start(&bad), None, "bad version");
            } else {
                assert_eq!(peeked, None, "{ext:?} at offset {offset}");
            }
        }
    }
}

/// Packets back to back in one datagram are found by their declared lengths, each of which
/// `decode` then accepts alone; `is_ack` tells an ACK from the rest.
#[test]
fn packet_len_splits_packets_that_share_a_datagram() {
    let samples = sample_exts();
    let mut datagram = Vec::new();
    for (ext, payload) in &samples {
        datagram.extend_from_slice(&encode(ext, payload));
    }
    let mut rest = &datagram[..];
    for (ext, payload) in &samples {
        let len = packet_len(rest).expect("a packet at the front");
        let (packet, tail) = rest.split_at(len);
        assert_eq!(packet, &encode(ext, payload)[..]);
        let decoded = decode(packet).expect("each packet decodes alone");
        assert_eq!(decoded.ext, *ext);
        assert_eq!(is_ack(packet), ext.opcode() == Opcode::Ack);
        rest = tail;
    }
    assert!(rest.is_empty());
    // What is not a packet's start has no length; a truncated one's runs past the end.
    assert_eq!(packet_len(&[0u8; 40]), None);
    assert_eq!(packet_len(&datagram[..31]), None);
    let first = encode(&samples[0].0, &samples[0].1);
    assert_eq!(packet_len(&first[..33]), Some(first.len()));
}

proptest! {
    #[test]
    fn packet_len_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
        if let Some(n) = packet_len(&bytes) {
            prop_assert!(n >= COMMON_HEADER_LEN);
        }
        let _ = is_ack(&bytes);
    }
}

/// The CRC instruction (small datagrams, headers alone) and crc-fast's folding (the rest)
/// give the same CRC-32C: every length around the switch, with and without a data digest,
/// against a one-shot CRC of exactly the bytes covered.
#[test]
fn every_length_gets_the_crc_of_exactly_what_it_covers() {
    let payload: Vec<u8> = (0..1200u32).map(|i| (i * 31 + 7) as u8).collect();
    let seg = Segment {
        msg_first_psn: Psn(3),
        imm_or_req: 0,
        offset: 0,
        msg_len: payload.len() as u64,
    };
    for len in (0..300).chain([511, 512, 513, 1000, 1200]) {
        for digest in [0, FLAG_DATA_DIGEST] {
            let bytes = encode_with(&Ext::Send(seg), &payload[..len], digest);
            let header_len = bytes.len() - len;
            let end = if digest == 0 { header_len } else { bytes.len() };
            let mut covered = bytes[..CRC_RANGE.start].to_vec();
            covered.extend_from_slice(&bytes[CRC_RANGE.end..end]);
            let expected = crc_algebra::crc32c(&covered);
            assert_eq!(crc_of(&bytes), expected, "{len} bytes, flags {digest}");
            let (head, rest) = bytes.split_at(header_len);
            assert_eq!(
                crc_of_parts(head, |feed| feed(rest)),
                expected,
                "{len} bytes in two parts, flags {digest}"
            );
        }
    }
}

/// A datagram received in two pieces (headers, then payload) decodes exactly as the whole,
/// with or without a data digest, and only when it is cut where its headers end.
#[test]
fn a_datagram_in_two_pieces_decodes_as_the_whole_and_only_when_cut_after_its_headers() {
    let long = (0..3000u32).map(|i| (i * 13 + 1) as u8).collect::<Vec<_>>();
    for (ext, payload) in sample_exts() {
        for payload in [payload, long.clone()] {
            if payload.is_empty() || !ext.opcode().carries_data() {
                continue;
            }
            for digest in [0, FLAG_DATA_DIGEST] {
                let mut ext = ext;
                if let Ext::Send(seg)
                | Ext::Write(seg, _)
                | Ext::WriteWithImm(seg, _)
                | Ext::ReadResponse(seg) = &mut ext
                {
                    seg.offset = 0;
                    seg.msg_len = payload.len() as u64;
                }
                let bytes = encode_with(&ext, &payload, digest);
                let cut = bytes.len() - payload.len();
                let whole = decode(&bytes).unwrap_or_else(|e| panic!("{ext:?}: {e}"));
                let parts = decode_parts(&bytes[..cut], &bytes[cut..])
                    .unwrap_or_else(|e| panic!("{ext:?} in two pieces: {e}"));
                assert_eq!(parts, whole);
                for wrong in [cut - 1, cut + 1] {
                    assert!(
                        decode_parts(&bytes[..wrong], &bytes[wrong..]).is_err(),
                        "{ext:?} cut at {wrong} instead of {cut} accepted"
                    );
                }
                // A flipped header bit is caught; so is a flipped payload bit under a digest.
                for at in [0, 3, 5, cut - 1, cut, bytes.len() - 1] {
                    let mut bad = bytes.clone();
                    bad[at] ^= 0x10;
                    let decoded = decode_parts(&bad[..cut], &bad[cut..]);
                    if at >= cut && digest == 0 {
                        assert!(decoded.is_ok(), "{ext:?}: payload byte {at}");
                    } else {
                        assert!(decoded.is_err(), "{ext:?}, flags {digest}: byte {at}");
                    }
                }
            }
        }
    }
}

proptest! {
    #[test]
    fn arbitrary_pieces_never_panic(
        bytes in proptest::collection::vec(any::<u8>(), 0..200),
        cut in 0usize..200,
    ) {
        let cut = cut.min(bytes.len());
        let _ = decode_parts(&bytes[..cut], &bytes[cut..]);
    }
}

/// Every opcode's headers, byte for byte, as the cursor-based encoder before 2026-12-06 wrote
/// them (and as docs/wire-format.md lays them out): the fixed-offset encoder and decoder that
/// replaced it must not move a field. Each field holds distinct bytes, so a field written at
/// the wrong offset, with the wrong width or byte order, shows.
#[test]
fn every_header_keeps_its_layout_byte_for_byte() {
    let seg = Segment {
        msg_first_psn: Psn(0x0102_0304),
        imm_or_req: 0x0506_0708,
        offset: 0x1112_1314_1516_1718,
        msg_len: 0x2122_2324_2526_2728,
    };
    let rem = Remote {
        rkey: 0x3132_3334,
        addr: 0x4142_4344_4546_4748,
    };
    let hs = Handshake {
        src_qpn: 0x5152_5354,
        initial_psn: Psn(0x6162_6364),
        max_payload: 0x7172_7374,
        window: 0x8182_8384,
    };
    let mut sacks = SackList::default();
    sacks.push(SackBlock {
        start: Psn(10),
        end: Psn(20),
    });
    let common = "d8d7d6d5d4d3d2d1e4e3e2e1f4f3f2f10d0c0b0a0000";
    let cases: [(Ext, usize, &str); 15] = [
        (
            Ext::Send(seg),
            3,
            "7442030100000000|0300040302010807060518171615141312112827262524232221",
        ),
        (
            Ext::ReadResponse(seg),
            2,
            "7442030500000000|0200040302010807060518171615141312112827262524232221",
        ),
        (
            Ext::Write(seg, rem),
            4,
            "7442030200000000|040004030201080706051817161514131211282726252423222134333231000000004847464544434241",
        ),
        (
            Ext::WriteWithImm(seg, rem),
            1,
            "7442030300000000|010004030201080706051817161514131211282726252423222134333231000000004847464544434241",
        ),
        (
            Ext::ReadRequest {
                remote: rem,
                len: 0x99,
            },
            0,
            "7442030400000000|0000343332310000000048474645444342419900000000000000",
        ),
        (
            Ext::FetchAdd {
                remote: rem,
                add: 0x77,
            },
            0,
            "7442030600000000|00003433323100000000484746454443424177000000000000000000000000000000",
        ),
        (
            Ext::CmpSwap {
                remote: rem,
                compare: 0x66,
                swap: 0x55,
            },
            0,
            "7442030700000000|00003433323100000000484746454443424166000000000000005500000000000000",
        ),
        (
            Ext::AtomicResponse {
                req_psn: Psn(0x44),
                original: 0x33,
            },
            0,
            "7442030800000000|000044000000000000003300000000000000",
        ),
        (
            Ext::FatalNak {
                req_psn: Psn(0x22),
                code: ErrorCode::from_u8(1).expect("a code"),
            },
            0,
            "7442030900000000|00002200000001000000",
        ),
        (
            Ext::Ack {
                window: 0xa1,
                receive_limit: 0xa2,
                sacks,
            },
            0,
            "7442031000000000|0800a1000000a2000000010000000a00000014000000",
        ),
        (
            Ext::Nak {
                psn: Psn(0xb1),
                code: NakCode::from_u8(1).expect("a code"),
                rnr_delay_us: 0xb2,
            },
            0,
            "7442031100000000|0000b100000001000000b2000000",
        ),
        (
            Ext::Connect(hs),
            0,
            "7442032000000000|000054535251646362617473727184838281",
        ),
        (
            Ext::Accept(hs),
            0,
            "7442032100000000|000054535251646362617473727184838281",
        ),
        (
            Ext::Close { reason: 0xc1 },
            0,
            "7442032200000000|0000c100000000000000",
        ),
        (Ext::KeepAlive, 0, "7442032300000000|0000"),
    ];
    for (ext, payload_len, expected) in cases {
        let header = Header {
            opcode: ext.opcode(),
            token: 0xd1d2_d3d4_d5d6_d7d8,
            dest_qpn: 0xe1e2_e3e4,
            psn: Psn(0xf1f2_f3f4),
            ack_psn: Psn(0x0a0b_0c0d),
            flags: 0,
        };
        let mut buf = [0xffu8; 200];
        let n = write_header(&mut buf, &header, &ext, payload_len);
        let written: String = buf[..n].iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(written, expected.replace('|', common), "{:?}", ext.opcode());
    }
}
