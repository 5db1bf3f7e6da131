//! The optional cluster secret and the authentication every side channel runs with it.
//!
//! tbrdma's side channels (the verbs connection manager, the collectives' rendezvous, hostfile
//! discovery, and through the connection manager the NCCL plugin) are reachable by anyone on
//! the link. When the operator sets a cluster secret, each of them first proves, both ways,
//! that the other end knows it, before trusting a byte it sends:
//!
//! - `TBRDMA_SECRET`: the secret itself (at least [`MIN_SECRET_LEN`] bytes), or
//! - `TBRDMA_SECRET_FILE`: a file holding it, which must be a regular file owned by this user
//!   (or root) and neither readable nor writable by group or others (`chmod 600`).
//!
//! This crate owns reading the setting ([`Secret::from_env`], [`Auth`]), the challenge-response
//! over a byte stream ([`client`], [`server`]: HMAC-SHA256 over a fresh nonce from each side, so
//! a recorded handshake cannot be replayed), the tags datagram protocols use ([`Secret::tag`],
//! [`Secret::verify`], [`fresh_nonce`]) and a stream view with one total deadline
//! ([`DeadlineStream`]) so a slow client cannot stretch a handshake by trickling bytes.
//!
//! The stream handshake, before the side channel's own first frame (every integer one byte):
//!
//! ```text
//! client -> server   "tbAU" 1 flags  client_nonce[32]                      (38 bytes)
//! server -> client   "tbAU" 1 flags  server_nonce[32]  server_tag[32]      (70 bytes)
//! client -> server   verdict  client_tag[32]         only when both have a secret (33 bytes)
//! ```
//!
//! `flags` bit 0: the sender has a secret. A tag is HMAC-SHA256 under the secret of
//! `"tbrdma-auth 1 server\0"` (or `client`), the side channel's context name, `\0`, then both
//! nonces (client's first). The server's tag (zeros when either side has no secret) proves the
//! server; `verdict` 0 says the client accepted it (1: it did not, and closes). Tags are compared
//! in constant time. What is authenticated is the peer, at the start of the connection; the
//! frames that follow are not signed (an attacker who can rewrite the TCP stream in flight is
//! outside the threat model, docs/security.md).

use std::ffi::OsString;
use std::fmt;
use std::io::{self, Read, Write};
use std::net::TcpStream;
use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// The environment variable holding the secret.
pub const SECRET_ENV: &str = "TBRDMA_SECRET";
/// The environment variable naming a file that holds the secret.
pub const SECRET_FILE_ENV: &str = "TBRDMA_SECRET_FILE";
/// Shortest secret accepted (bytes): `openssl rand -hex 32` gives 64.
pub const MIN_SECRET_LEN: usize = 16;
/// Longest secret (and secret file) accepted, in bytes.
pub const MAX_SECRET_LEN: usize = 4096;
/// Bytes of a nonce and of a tag.
pub const NONCE_LEN: usize = 32;
/// Bytes of a tag (HMAC-SHA256).
pub const TAG_LEN: usize = 32;

const MAGIC: &[u8; 4] = b"tbAU";
const VERSION: u8 = 1;
const HAS_SECRET: u8 = 1;
/// Bytes of the client's opening message.
pub const HELLO_LEN: usize = 4 + 1 + 1 + NONCE_LEN;
/// Bytes of the server's answer.
pub const ANSWER_LEN: usize = HELLO_LEN + TAG_LEN;
/// Bytes of the client's proof.
pub const PROOF_LEN: usize = 1 + TAG_LEN;

/// How to tell the user where the secret comes from.
const SETTING: &str = "TBRDMA_SECRET (or TBRDMA_SECRET_FILE)";

/// Why a side channel refused a peer or could not start.
#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    /// The secret's setting on this host is unusable (a bad file, a short secret).
    #[error("{0}")]
    Setting(String),
    /// The two hosts do not share a secret (one has none, or they differ).
    #[error("{0}")]
    Refused(String),
    /// The peer did not speak the handshake (another program, a truncated message).
    #[error("{0}")]
    Protocol(String),
    /// The stream failed or its deadline passed.
    #[error("{what}: {source}")]
    Io {
        /// What was being done.
        what: &'static str,
        /// The cause.
        source: io::Error,
    },
}

impl AuthError {
    /// True when this is a secret mismatch or a bad setting (the user must act), rather than a
    /// stranger's garbage or a dropped stream.
    pub fn is_refusal(&self) -> bool {
        matches!(self, AuthError::Refused(_) | AuthError::Setting(_))
    }
}

/// A cluster secret. Its `Debug` form never shows the bytes.
#[derive(Clone)]
pub struct Secret(Vec<u8>);

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Secret({} bytes)", self.0.len())
    }
}

impl Secret {
    /// A secret from its bytes (surrounding whitespace, such as a file's final newline, is not
    /// part of it).
    pub fn new(bytes: &[u8]) -> Result<Secret, AuthError> {
        let trimmed = bytes.trim_ascii();
        if trimmed.len() < MIN_SECRET_LEN || trimmed.len() > MAX_SECRET_LEN {
            return Err(AuthError::Setting(format!(
                "the cluster secret ({SETTING}) must be {MIN_SECRET_LEN} to {MAX_SECRET_LEN} bytes, not {}: generate one with `openssl rand -hex 32`",
                trimmed.len()
            )));
        }
        Ok(Secret(trimmed.to_vec()))
    }

    /// The secret this process's environment sets, if any (see the crate docs).
    pub fn from_env() -> Result<Option<Secret>, AuthError> {
        Secret::from_settings(
            std::env::var_os(SECRET_ENV),
            std::env::var_os(SECRET_FILE_ENV),
        )
    }

    /// The secret the two settings name: `secret` is `TBRDMA_SECRET`'s value, `file`
    /// `TBRDMA_SECRET_FILE`'s. Setting both is an error (which one would win is a surprise);
    /// an empty value counts as unset.
    pub fn from_settings(
        secret: Option<OsString>,
        file: Option<OsString>,
    ) -> Result<Option<Secret>, AuthError> {
        let secret = secret.filter(|s| !s.is_empty());
        let file = file.filter(|s| !s.is_empty());
        match (secret, file) {
            (None, None) => Ok(None),
            (Some(_), Some(_)) => Err(AuthError::Setting(format!(
                "both {SECRET_ENV} and {SECRET_FILE_ENV} are set: set only one"
            ))),
            (Some(s), None) => {
                use std::os::unix::ffi::OsStrExt;
                Secret::new(s.as_bytes()).map(Some)
            }
            (None, Some(path)) => Secret::from_file(Path::new(&path)).map(Some),
        }
    }

    /// Reads a secret file, refusing one that others could read or replace.
    pub fn from_file(path: &Path) -> Result<Secret, AuthError> {
        let shown = path.display();
        let setting = |detail: String| AuthError::Setting(format!("{SECRET_FILE_ENV}={detail}"));
        // Open first, then look at what was opened: no window for a swap between check and read.
        let file = std::fs::File::open(path)
            .map_err(|e| setting(format!("{shown}: cannot open it: {e}")))?;
        let meta = file
            .metadata()
            .map_err(|e| setting(format!("{shown}: {e}")))?;
        if !meta.is_file() {
            return Err(setting(format!("{shown} is not a regular file")));
        }
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o077 != 0 {
            return Err(setting(format!(
                "{shown} has mode {mode:03o}, so other users may read or change it: `chmod 600 {shown}`"
            )));
        }
        let me = nix::unistd::geteuid().as_raw();
        if meta.uid() != me && meta.uid() != 0 {
            return Err(setting(format!(
                "{shown} belongs to user {}, not to this user ({me}) or root",
                meta.uid()
            )));
        }
        let mut bytes = Vec::new();
        file.take(MAX_SECRET_LEN as u64 + 2)
            .read_to_end(&mut bytes)
            .map_err(|e| setting(format!("{shown}: reading it: {e}")))?;
        Secret::new(&bytes).map_err(|e| setting(format!("{shown}: {e}")))
    }

    fn mac(&self) -> Hmac<Sha256> {
        <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC takes keys of any length")
    }

    /// HMAC-SHA256 of the concatenation of `parts`. Callers put a label naming the protocol and
    /// the message kind first, and fixed-length or length-prefixed parts after it, so two
    /// different messages never concatenate to the same bytes.
    pub fn tag(&self, parts: &[&[u8]]) -> [u8; TAG_LEN] {
        let mut mac = self.mac();
        for part in parts {
            mac.update(part);
        }
        mac.finalize().into_bytes().into()
    }

    /// Whether `tag` is [`Secret::tag`] of `parts`, compared in constant time.
    pub fn verify(&self, parts: &[&[u8]], tag: &[u8]) -> bool {
        let mut mac = self.mac();
        for part in parts {
            mac.update(part);
        }
        mac.verify_slice(tag).is_ok()
    }
}

/// Where a side channel takes its secret from.
#[derive(Debug, Clone, Default)]
pub enum Auth {
    /// `TBRDMA_SECRET` / `TBRDMA_SECRET_FILE`, read at each handshake (the default: every
    /// program honours the operator's setting without code of its own).
    #[default]
    FromEnvironment,
    /// No secret, whatever the environment says.
    Disabled,
    /// This secret.
    Secret(Arc<Secret>),
}

impl Auth {
    /// Authentication with `secret`.
    pub fn with_secret(secret: Secret) -> Auth {
        Auth::Secret(Arc::new(secret))
    }

    /// The secret to use now, if any.
    pub fn resolve(&self) -> Result<Option<Arc<Secret>>, AuthError> {
        match self {
            Auth::FromEnvironment => Ok(Secret::from_env()?.map(Arc::new)),
            Auth::Disabled => Ok(None),
            Auth::Secret(s) => Ok(Some(s.clone())),
        }
    }
}

/// A fresh random nonce from the kernel (`getrandom(2)`); an error if it fails, never a
/// predictable value.
pub fn fresh_nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut nonce = [0u8; NONCE_LEN];
    getrandom::fill(&mut nonce).map_err(|e| AuthError::Io {
        what: "drawing a nonce from the kernel's random generator",
        source: io::Error::other(e.to_string()),
    })?;
    Ok(nonce)
}

/// The opening message (the client's) or the first part of the answer (the server's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hello {
    /// The sender has a secret.
    pub has_secret: bool,
    /// The sender's nonce.
    pub nonce: [u8; NONCE_LEN],
}

impl Hello {
    fn encode(&self) -> [u8; HELLO_LEN] {
        let mut out = [0u8; HELLO_LEN];
        out[..4].copy_from_slice(MAGIC);
        out[4] = VERSION;
        out[5] = if self.has_secret { HAS_SECRET } else { 0 };
        out[6..].copy_from_slice(&self.nonce);
        out
    }
}

/// Parses an opening message (also the first [`HELLO_LEN`] bytes of an answer). Whatever the
/// bytes, an error or a value, never a panic.
pub fn decode_hello(bytes: &[u8]) -> Result<Hello, AuthError> {
    if bytes.len() < HELLO_LEN {
        return Err(AuthError::Protocol(
            "authentication message truncated".into(),
        ));
    }
    if &bytes[..4] != MAGIC {
        return Err(AuthError::Protocol(
            "the peer is not a tbrdma side channel of this version (no authentication preamble)"
                .into(),
        ));
    }
    if bytes[4] != VERSION {
        return Err(AuthError::Protocol(format!(
            "the peer speaks authentication version {}, this build {VERSION}: use the same tbrdma on every host",
            bytes[4]
        )));
    }
    if bytes[5] & !HAS_SECRET != 0 {
        return Err(AuthError::Protocol("unknown authentication flags".into()));
    }
    let mut nonce = [0u8; NONCE_LEN];
    nonce.copy_from_slice(&bytes[6..HELLO_LEN]);
    Ok(Hello {
        has_secret: bytes[5] & HAS_SECRET != 0,
        nonce,
    })
}

fn label(role: &str, context: &str) -> Vec<u8> {
    format!("tbrdma-auth {VERSION} {role}\0{context}\0").into_bytes()
}

fn server_tag(secret: &Secret, context: &str, client: &[u8], server: &[u8]) -> [u8; TAG_LEN] {
    secret.tag(&[&label("server", context), client, server])
}

fn client_parts<'a>(label: &'a [u8], client: &'a [u8], server: &'a [u8]) -> [&'a [u8]; 3] {
    [label, client, server]
}

/// Compares the two sides' settings: an error naming the setting when exactly one has a secret.
fn mismatch(ours: bool, theirs: bool) -> Option<AuthError> {
    match (ours, theirs) {
        (false, true) => Some(AuthError::Refused(format!(
            "the peer requires a cluster secret and this host has none: set {SETTING} to the cluster's secret here"
        ))),
        (true, false) => Some(AuthError::Refused(format!(
            "this host has a cluster secret ({SETTING}) and the peer has none: set the same secret on every host"
        ))),
        _ => None,
    }
}

fn differs() -> AuthError {
    AuthError::Refused(format!(
        "the peer's cluster secret is not this host's (or its handshake was replayed): set the same {SETTING} on every host"
    ))
}

fn io_err(what: &'static str) -> impl FnOnce(io::Error) -> AuthError {
    move |source| AuthError::Io { what, source }
}

/// The client's side of the handshake, before the side channel's first frame. `context` names
/// the side channel (both ends must pass the same).
pub fn client(
    stream: &mut impl ReadWrite,
    secret: Option<&Secret>,
    context: &str,
) -> Result<(), AuthError> {
    let ours = Hello {
        has_secret: secret.is_some(),
        nonce: fresh_nonce()?,
    };
    stream
        .write_all(&ours.encode())
        .and_then(|()| stream.flush())
        .map_err(io_err("sending the authentication preamble"))?;
    let mut answer = [0u8; ANSWER_LEN];
    stream
        .read_exact(&mut answer)
        .map_err(io_err("reading the peer's authentication answer"))?;
    let theirs = decode_hello(&answer)?;
    if let Some(e) = mismatch(ours.has_secret, theirs.has_secret) {
        return Err(e);
    }
    let Some(secret) = secret else {
        return Ok(());
    };
    let expected_ok = secret.verify(
        &[&label("server", context), &ours.nonce, &theirs.nonce],
        &answer[HELLO_LEN..],
    );
    let mut proof = [0u8; PROOF_LEN];
    proof[0] = u8::from(!expected_ok);
    if expected_ok {
        let l = label("client", context);
        proof[1..].copy_from_slice(&secret.tag(&client_parts(&l, &ours.nonce, &theirs.nonce)));
    }
    // Tell the server either way, so it can say why too.
    let _ = stream.write_all(&proof).and_then(|()| stream.flush());
    if expected_ok { Ok(()) } else { Err(differs()) }
}

/// The server's side of the handshake: reads the client's preamble, answers, and checks its
/// proof. On a mismatch the client is told (through the answer) before the error returns.
pub fn server(
    stream: &mut impl ReadWrite,
    secret: Option<&Secret>,
    context: &str,
) -> Result<(), AuthError> {
    let mut first = [0u8; HELLO_LEN];
    stream
        .read_exact(&mut first)
        .map_err(io_err("reading the authentication preamble"))?;
    let theirs = decode_hello(&first)?;
    let ours = Hello {
        has_secret: secret.is_some(),
        nonce: fresh_nonce()?,
    };
    let mut answer = [0u8; ANSWER_LEN];
    answer[..HELLO_LEN].copy_from_slice(&ours.encode());
    if let (Some(secret), true) = (secret, theirs.has_secret) {
        answer[HELLO_LEN..].copy_from_slice(&server_tag(
            secret,
            context,
            &theirs.nonce,
            &ours.nonce,
        ));
    }
    stream
        .write_all(&answer)
        .and_then(|()| stream.flush())
        .map_err(io_err("sending the authentication answer"))?;
    if let Some(e) = mismatch(ours.has_secret, theirs.has_secret) {
        return Err(e);
    }
    let Some(secret) = secret else {
        return Ok(());
    };
    let mut proof = [0u8; PROOF_LEN];
    stream
        .read_exact(&mut proof)
        .map_err(io_err("reading the peer's authentication proof"))?;
    let l = label("client", context);
    let parts = client_parts(&l, &theirs.nonce, &ours.nonce);
    if proof[0] != 0 || !secret.verify(&parts, &proof[1..]) {
        return Err(differs());
    }
    Ok(())
}

/// What the handshake needs of a stream.
pub trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// A TCP stream seen through one total deadline: every read and write waits at most until it,
/// so a peer trickling a byte at a time cannot stretch an exchange past it.
#[derive(Debug)]
pub struct DeadlineStream<'a> {
    stream: &'a TcpStream,
    deadline: Instant,
}

impl<'a> DeadlineStream<'a> {
    /// `stream` until `deadline`. The stream must be in blocking mode.
    pub fn new(stream: &'a TcpStream, deadline: Instant) -> Self {
        DeadlineStream { stream, deadline }
    }

    /// What is left before the deadline, or a `TimedOut` error once it has passed.
    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the side channel's deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for DeadlineStream<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.read(buf).map_err(timed_out)
    }
}

impl Write for DeadlineStream<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.remaining()?))?;
        let mut s = self.stream;
        s.write(buf).map_err(timed_out)
    }

    fn flush(&mut self) -> io::Result<()> {
        let mut s = self.stream;
        s.flush()
    }
}

/// A socket timeout reads as `WouldBlock` on Linux; call it what it is.
fn timed_out(e: io::Error) -> io::Error {
    if e.kind() == io::ErrorKind::WouldBlock {
        io::Error::new(
            io::ErrorKind::TimedOut,
            "the side channel's deadline passed",
        )
    } else {
        e
    }
}

#[cfg(test)]
mod tests;
