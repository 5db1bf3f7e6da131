//! Whatever a client sends a side channel's authentication: the server side of the handshake
//! (with and without a secret) ends in an error or, only without a secret, success; it never
//! panics and never accepts a client's proof under a secret the input cannot know.
#![no_main]

use std::io::{Read, Write};

use libfuzzer_sys::fuzz_target;
use tbrdma_auth::{Secret, decode_hello, server};

/// Reads the fuzzer's bytes, swallows what the server writes.
struct Replay<'a>(&'a [u8]);

impl Read for Replay<'_> {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        self.0.read(buf)
    }
}

impl Write for Replay<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fuzz_target!(|data: &[u8]| {
    let _ = decode_hello(data);
    let _ = server(&mut Replay(data), None, "fuzz");
    let secret = Secret::new(b"a-secret-for-the-fuzzer").expect("long enough");
    // The server's nonce is fresh: no fixed input can carry the proof for it.
    assert!(server(&mut Replay(data), Some(&secret), "fuzz").is_err());
});
