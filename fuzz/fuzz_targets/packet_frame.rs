//! Any frame the packet engine's ring hands over (what follows the Ethernet header): it is
//! either refused or split into the datagram that follows the 12-byte shim and its sender.
#![no_main]

use std::net::{Ipv4Addr, SocketAddrV4};

use libfuzzer_sys::fuzz_target;
use tbrdma_engine::io::packet::{SHIM, parse_frame, shim_for};

fuzz_target!(|data: &[u8]| {
    let local = SocketAddrV4::new(Ipv4Addr::new(169, 254, 0, 1), 4791);
    let to_us = shim_for(local);
    // The fuzzer's bytes as they come, and behind a shim naming this rail.
    let mut framed = to_us[..6].to_vec();
    framed.extend_from_slice(data);
    for frame in [data, &framed[..]] {
        if let Some((datagram, _from)) = parse_frame(frame, &to_us) {
            assert!(!datagram.is_empty());
            assert_eq!(datagram.len() + SHIM, frame.len());
            assert_eq!(frame[..6], to_us[..6]);
        }
    }
});
