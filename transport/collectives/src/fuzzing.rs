//! What the cargo-fuzz targets (`fuzz/` at the repository root) drive: the rendezvous'
//! announcement parser, fed whatever a stranger could send rank 0.

/// Parses `bytes` as an announcement; what parses re-encodes to text that parses the same.
pub fn rendezvous_announce(bytes: &[u8]) {
    if let Ok(a) = crate::rendezvous::decode(&mut &bytes[..]) {
        assert!(a.addrs.len() <= crate::rendezvous::MAX_ADDRS);
        let text = crate::rendezvous::encode(&a);
        let again = crate::rendezvous::decode(&mut text.as_bytes()).expect("re-encoded parses");
        assert_eq!(
            (again.world, again.rank, again.host),
            (a.world, a.rank, a.host)
        );
        assert_eq!(again.addrs, a.addrs);
    }
}
