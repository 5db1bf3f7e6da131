//! Any datagram: decoding never panics, and what decodes re-encodes to the same packet.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tbrdma_proto::fuzzing::decode_packet(data));
