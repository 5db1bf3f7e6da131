//! The one little-endian reader and writer behind every hand-written frame in tbrdma: the wire
//! format (`wire/`), the connection manager's side-channel frames (`tbrdma-verbs`), the
//! collectives' configuration digest and the NCCL plugin's handles and control messages.
//!
//! - [`Reader`] is a cursor over received bytes: every read returns `None` past the end, so a
//!   decoder built on it cannot panic or read out of bounds whatever a peer sends. [`u16_at`],
//!   [`u32_at`] and [`u64_at`] are the same check for a field at a fixed offset.
//! - [`u16_in`], [`u32_in`], [`u64_in`], [`array_in`] and [`put_in`] read and write a field at a constant
//!   offset of a fixed-size array (a header whose length was checked once): whether the field
//!   fits is checked when the code is compiled, so the per-message headers cost no check per
//!   field.
//! - [`Put`] writes integers, bytes and socket addresses, either appended to a `Vec<u8>` or into
//!   a caller-sized slice through [`SliceWriter`]. Writing past a slice's end is a programming
//!   error (the caller sized the slice for the frame), never a reaction to input: it panics.
//!
//! Why not `bytes`' `Buf`/`BufMut`: their `get_*`/`put_*` panic on short input (only the
//! `try_get_*` reads are checked), they carry both byte orders under long names, and the core
//! would take a dependency for what is a hundred lines here; the socket-address layout shared by
//! the connection manager and the plugin's handle would still be ours to write.

use std::net::{IpAddr, Ipv6Addr, SocketAddr};

/// Bytes of an encoded [`SocketAddr`]: a 16-byte IPv6 (or IPv4-mapped) address and a u16 port.
pub const SOCKET_ADDR_LEN: usize = 18;

/// A read cursor over a byte slice. Every read returns `None`, and consumes nothing, when fewer
/// bytes are left than it needs.
#[derive(Clone, Debug)]
pub struct Reader<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { bytes, pos: 0 }
    }

    /// The next `n` bytes.
    pub fn bytes(&mut self, n: usize) -> Option<&'a [u8]> {
        let end = self.pos.checked_add(n)?;
        let chunk = self.bytes.get(self.pos..end)?;
        self.pos = end;
        Some(chunk)
    }

    /// The next `N` bytes as an array.
    pub fn array<const N: usize>(&mut self) -> Option<[u8; N]> {
        self.bytes(N)?.try_into().ok()
    }

    /// The next byte.
    pub fn u8(&mut self) -> Option<u8> {
        self.array::<1>().map(|b| b[0])
    }

    /// The next little-endian u16.
    pub fn u16(&mut self) -> Option<u16> {
        self.array().map(u16::from_le_bytes)
    }

    /// The next little-endian u32.
    pub fn u32(&mut self) -> Option<u32> {
        self.array().map(u32::from_le_bytes)
    }

    /// The next little-endian u64.
    pub fn u64(&mut self) -> Option<u64> {
        self.array().map(u64::from_le_bytes)
    }

    /// A socket address as [`Put::put_socket_addr`] writes it; an IPv4-mapped address comes
    /// back as IPv4.
    pub fn socket_addr(&mut self) -> Option<SocketAddr> {
        let ip = Ipv6Addr::from(self.array::<16>()?);
        let port = self.u16()?;
        let ip = ip.to_ipv4_mapped().map_or(IpAddr::V6(ip), IpAddr::V4);
        Some(SocketAddr::new(ip, port))
    }

    /// Skips `n` bytes (padding).
    pub fn skip(&mut self, n: usize) -> Option<()> {
        self.bytes(n).map(|_| ())
    }
}

/// The little-endian u16 at byte `at` of `bytes`, if all of it is there.
pub fn u16_at(bytes: &[u8], at: usize) -> Option<u16> {
    Reader::new(bytes.get(at..)?).u16()
}

/// The little-endian u32 at byte `at` of `bytes`, if all of it is there.
pub fn u32_at(bytes: &[u8], at: usize) -> Option<u32> {
    Reader::new(bytes.get(at..)?).u32()
}

/// The little-endian u64 at byte `at` of `bytes`, if all of it is there.
pub fn u64_at(bytes: &[u8], at: usize) -> Option<u64> {
    Reader::new(bytes.get(at..)?).u64()
}

/// The little-endian u16 at byte `AT` of the fixed-size header `bytes`. Whether it fits is
/// checked when the code is compiled, so a decoder that checked the header's length once reads
/// its fields with no further checks (a header's fields are at fixed offsets).
pub fn u16_in<const AT: usize, const N: usize>(bytes: &[u8; N]) -> u16 {
    u16::from_le_bytes(array_in::<AT, 2, N>(bytes))
}

/// The little-endian u32 at byte `AT` of `bytes` (see [`u16_in`]).
pub fn u32_in<const AT: usize, const N: usize>(bytes: &[u8; N]) -> u32 {
    u32::from_le_bytes(array_in::<AT, 4, N>(bytes))
}

/// The little-endian u64 at byte `AT` of `bytes` (see [`u16_in`]).
pub fn u64_in<const AT: usize, const N: usize>(bytes: &[u8; N]) -> u64 {
    u64::from_le_bytes(array_in::<AT, 8, N>(bytes))
}

/// Writes `value` at byte `AT` of the fixed-size header `bytes`, checked when compiled (see
/// [`u16_in`]): an encoder that builds a header in an array pays for no bounds checks.
pub fn put_in<const AT: usize, const W: usize, const N: usize>(
    bytes: &mut [u8; N],
    value: [u8; W],
) {
    const { assert!(AT + W <= N, "field past the end of its header") };
    let mut i = 0;
    while i < W {
        bytes[AT + i] = value[i];
        i += 1;
    }
}

/// The `W` bytes at byte `AT` of the fixed-size header `bytes` (see [`u16_in`]): a part of a
/// header laid out the same wherever it sits (a remote buffer, say).
pub fn array_in<const AT: usize, const W: usize, const N: usize>(bytes: &[u8; N]) -> [u8; W] {
    const { assert!(AT + W <= N, "field past the end of its header") };
    let mut out = [0u8; W];
    let mut i = 0;
    while i < W {
        out[i] = bytes[AT + i];
        i += 1;
    }
    out
}

/// Little-endian writes; the one required method says where bytes go.
pub trait Put {
    /// Writes `bytes` as they are.
    fn put_bytes(&mut self, bytes: &[u8]);

    /// Writes one byte.
    fn put_u8(&mut self, v: u8) {
        self.put_bytes(&[v]);
    }

    /// Writes a little-endian u16.
    fn put_u16(&mut self, v: u16) {
        self.put_bytes(&v.to_le_bytes());
    }

    /// Writes a little-endian u32.
    fn put_u32(&mut self, v: u32) {
        self.put_bytes(&v.to_le_bytes());
    }

    /// Writes a little-endian u64.
    fn put_u64(&mut self, v: u64) {
        self.put_bytes(&v.to_le_bytes());
    }

    /// Writes `n` zero bytes (padding).
    fn put_zeros(&mut self, n: usize) {
        for _ in 0..n {
            self.put_u8(0);
        }
    }

    /// Writes a socket address in [`SOCKET_ADDR_LEN`] bytes: the IPv6 address (an IPv4 one
    /// mapped into IPv6), then the port.
    fn put_socket_addr(&mut self, addr: SocketAddr) {
        let ip = match addr.ip() {
            IpAddr::V4(v4) => v4.to_ipv6_mapped(),
            IpAddr::V6(v6) => v6,
        };
        self.put_bytes(&ip.octets());
        self.put_u16(addr.port());
    }
}

/// Appends.
impl Put for Vec<u8> {
    fn put_bytes(&mut self, bytes: &[u8]) {
        self.extend_from_slice(bytes);
    }

    fn put_zeros(&mut self, n: usize) {
        self.resize(self.len() + n, 0);
    }
}

/// A write cursor over a slice the caller has sized for what is written.
#[derive(Debug)]
pub struct SliceWriter<'a> {
    bytes: &'a mut [u8],
    pos: usize,
}

impl<'a> SliceWriter<'a> {
    /// A cursor at the start of `bytes`.
    pub fn new(bytes: &'a mut [u8]) -> Self {
        SliceWriter { bytes, pos: 0 }
    }

    /// Bytes written so far.
    pub fn position(&self) -> usize {
        self.pos
    }

    fn next(&mut self, n: usize) -> &mut [u8] {
        let room = self.bytes.len() - self.pos;
        assert!(
            n <= room,
            "frame writer: {n} bytes do not fit the {room} left of a {}-byte buffer",
            self.bytes.len()
        );
        let chunk = &mut self.bytes[self.pos..self.pos + n];
        self.pos += n;
        chunk
    }
}

/// Writes in place.
///
/// # Panics
/// Past the end of the slice: the caller sizes it for the frame, so this is a programming error.
impl Put for SliceWriter<'_> {
    fn put_bytes(&mut self, bytes: &[u8]) {
        self.next(bytes.len()).copy_from_slice(bytes);
    }

    fn put_zeros(&mut self, n: usize) {
        self.next(n).fill(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trip_through_a_vec_and_a_slice() {
        let addrs: [SocketAddr; 2] = [
            "10.0.0.1:4791".parse().unwrap(),
            "[fe80::1]:7".parse().unwrap(),
        ];
        let mut v = Vec::new();
        v.put_u8(1);
        v.put_u16(0x0203);
        v.put_u32(0x0405_0607);
        v.put_u64(0x0809_0a0b_0c0d_0e0f);
        v.put_zeros(3);
        for a in addrs {
            v.put_socket_addr(a);
        }
        assert_eq!(&v[..7], &[1, 3, 2, 7, 6, 5, 4]);
        assert_eq!(v.len(), 1 + 2 + 4 + 8 + 3 + 2 * SOCKET_ADDR_LEN);

        let mut s = vec![0xffu8; v.len()];
        let mut w = SliceWriter::new(&mut s);
        w.put_u8(1);
        w.put_u16(0x0203);
        w.put_u32(0x0405_0607);
        w.put_u64(0x0809_0a0b_0c0d_0e0f);
        w.put_zeros(3);
        for a in addrs {
            w.put_socket_addr(a);
        }
        assert_eq!(w.position(), v.len());
        assert_eq!(s, v);

        let mut r = Reader::new(&v);
        assert_eq!(r.u8(), Some(1));
        assert_eq!(r.u16(), Some(0x0203));
        assert_eq!(r.u32(), Some(0x0405_0607));
        assert_eq!(r.u64(), Some(0x0809_0a0b_0c0d_0e0f));
        assert_eq!(r.skip(3), Some(()));
        assert_eq!(r.socket_addr(), Some(addrs[0]));
        assert_eq!(r.socket_addr(), Some(addrs[1]));
        assert_eq!(r.u8(), None);
        assert_eq!(u32_at(&v, 3), Some(0x0405_0607));
    }

    #[test]
    fn short_input_reads_none_and_consumes_nothing() {
        let bytes = [1u8, 2, 3];
        let mut r = Reader::new(&bytes);
        assert_eq!(r.u32(), None);
        assert_eq!(r.u16(), Some(0x0201));
        assert_eq!(r.u16(), None);
        assert_eq!(r.skip(2), None);
        assert_eq!(r.bytes(usize::MAX), None);
        assert_eq!(r.socket_addr(), None);
        assert_eq!(r.u8(), Some(3));
        assert_eq!(r.u8(), None);
        assert_eq!(u16_at(&bytes, 2), None);
        assert_eq!(u64_at(&bytes, usize::MAX), None);
    }

    #[test]
    #[should_panic(expected = "do not fit")]
    fn writing_past_a_slice_is_a_programming_error() {
        let mut s = [0u8; 3];
        SliceWriter::new(&mut s).put_u32(1);
    }
}
