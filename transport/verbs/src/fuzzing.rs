//! What the cargo-fuzz targets (`fuzz/` at the repository root) drive: the connection
//! manager's frame parser, fed whatever a stranger could send.

/// Parses `body` as a side-channel frame body; what decodes re-encodes to the same bytes
/// (less a missing trailing byte, which means UDP) and decodes to the same frame.
pub fn cm_frame(body: &[u8]) {
    if let Ok(frame) = crate::cm::decode_frame(body) {
        let bytes = crate::cm::encode_frame(&frame);
        assert_eq!(crate::cm::decode_frame(&bytes[4..]), Ok(frame));
    }
}
