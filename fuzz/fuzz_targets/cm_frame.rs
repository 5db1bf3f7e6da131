//! Any connection-manager frame body (what follows its 4-byte length on the side channel):
//! decoding never panics, and what decodes re-encodes to a frame that decodes the same.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| tbrdma_verbs::fuzzing::cm_frame(data));
