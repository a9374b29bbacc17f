//! The wire format between `kvtier serve` and its clients, defined once.
//!
//! Every message is one frame: a 16-byte [`Header`] (body length, message
//! kind, request id, all little-endian) and a body of at most
//! [`MAX_BODY_BYTES`]. Inside a body every variable part carries its length
//! first and is bounded ([`MAX_KEYS`] keys, [`MAX_TEXT_BYTES`] of text), so a
//! reader never allocates more than the frame it already bounded. A client's
//! first frame is [`Request::Hello`] with [`MAGIC`] and [`VERSION`]; the
//! service answers [`Response::Welcome`] (the pool's geometry, namespace and
//! model) with the client's shared memory file attached (`SCM_RIGHTS`), or
//! refuses and closes. A [`ClientKind::LookupOnly`] client (an engine's
//! scheduler) shares no memory: its welcome carries no file, and it may
//! look up, pin and unpin but not load or store.
//!
//! The hello's first twelve bytes (magic, version) and the refusal frame
//! are the same in every version, so a client and a service of different
//! releases always get to say which versions they speak.
//!
//! Anything that does not decode (a wrong magic or version, an unknown kind,
//! a length past its bound, bytes left over) is a [`crate::ErrorKind::Usage`]
//! error naming what was wrong: the service drops that client, and only it.

use crate::error::{Error, ErrorKind, Failure, Result};
use crate::model::{DType, KvGeometry};
use crate::pool::Key;
use crate::tier::{JobKind, JobResult, KeyOutcome};
use std::ops::Range;

/// The first eight bytes of a hello.
pub const MAGIC: [u8; 8] = *b"KVTIERSV";
/// The protocol version this build speaks; a hello with another is refused.
/// 2: the welcome names the pool's namespace and model; lookup-only clients.
pub const VERSION: u32 = 2;
/// Bytes of a frame header.
pub const HEADER_BYTES: usize = 16;
/// Largest body a frame may carry (a job of [`MAX_KEYS`] keys fits).
pub const MAX_BODY_BYTES: u32 = 8 << 20;
/// Most keys (and memory blocks) one request or result names.
pub const MAX_KEYS: usize = 1 << 16;
/// Longest message text a failure carries (longer ones are cut).
pub const MAX_TEXT_BYTES: usize = 4096;
/// Longest usage report.
pub const MAX_LONG_TEXT_BYTES: usize = 1 << 20;

/// A frame's header, as it is laid out on the wire (little-endian).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(C)]
pub struct Header {
    /// Bytes of the body that follows.
    pub body_len: u32,
    /// The message kind (`Request::kind` / `Response::kind`).
    pub kind: u16,
    /// Zero in this version.
    pub flags: u16,
    /// The request this frame is or answers; 0 for events.
    pub req: u64,
}

const _: () = assert!(std::mem::size_of::<Header>() == HEADER_BYTES);

impl Header {
    /// The header's bytes.
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..4].copy_from_slice(&self.body_len.to_le_bytes());
        b[4..6].copy_from_slice(&self.kind.to_le_bytes());
        b[6..8].copy_from_slice(&self.flags.to_le_bytes());
        b[8..16].copy_from_slice(&self.req.to_le_bytes());
        b
    }

    /// Parses and bounds a header: a body past [`MAX_BODY_BYTES`] or set
    /// flags are refused before anything is allocated.
    pub fn decode(b: &[u8; HEADER_BYTES]) -> Result<Header> {
        let h = Header {
            body_len: u32::from_le_bytes(b[0..4].try_into().expect("4 bytes")),
            kind: u16::from_le_bytes(b[4..6].try_into().expect("2 bytes")),
            flags: u16::from_le_bytes(b[6..8].try_into().expect("2 bytes")),
            req: u64::from_le_bytes(b[8..16].try_into().expect("8 bytes")),
        };
        if h.body_len > MAX_BODY_BYTES {
            return Err(bad(format!(
                "a frame of {} bytes is larger than the {MAX_BODY_BYTES} a frame may be",
                h.body_len
            )));
        }
        if h.flags != 0 {
            return Err(bad(format!(
                "frame flags {:#x} are not defined in protocol version {VERSION}",
                h.flags
            )));
        }
        Ok(h)
    }
}

fn bad(msg: impl std::fmt::Display) -> Error {
    Error::InvalidArgument(format!("kvtier service protocol: {msg}"))
}

/// What a client is to the service, said in its hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientKind {
    /// An engine process: the service shares KV memory with it, and it
    /// loads and stores through that memory.
    Memory,
    /// Lookups, pins and unpins only (an engine's scheduler): no memory,
    /// no client slot; loads and stores are refused.
    LookupOnly,
}

impl ClientKind {
    fn code(self) -> u32 {
        match self {
            ClientKind::Memory => 0,
            ClientKind::LookupOnly => 1,
        }
    }
    fn of(code: u32) -> Option<ClientKind> {
        match code {
            0 => Some(ClientKind::Memory),
            1 => Some(ClientKind::LookupOnly),
            _ => None,
        }
    }
}

/// The text of a version mismatch, from either side.
pub fn version_mismatch(client: u32, service: u32) -> String {
    format!(
        "this kvtier client speaks service protocol version {client} and the kvtier service version {service}: run the engines' kvtier library and `kvtier serve` from one kvtier release (upgrade the older one and restart it)"
    )
}

/// What a client asks.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Request {
    /// The first frame: protocol magic and version, what the client is, and
    /// how many KV memory blocks it wants shared with the service.
    Hello {
        /// [`VERSION`] of the client.
        version: u32,
        /// Memory blocks wanted (0: as many as the service gives a client;
        /// must be 0 for a lookup-only client).
        blocks: u32,
        /// A client with memory, or a lookup-only one.
        kind: ClientKind,
    },
    /// `lookup_prefix`.
    Lookup(Vec<Key>),
    /// `lookup_and_pin`: the pins count as this client's.
    LookupAndPin(Vec<Key>),
    /// `unpin`: only pins this client holds are dropped.
    Unpin(Vec<Key>),
    /// `remove`.
    Remove(Vec<Key>),
    /// `submit_load` into this client's memory blocks.
    SubmitLoad {
        /// The keys.
        keys: Vec<Key>,
        /// One memory block (the client's numbering) per key.
        blocks: Vec<u32>,
        /// The layers.
        layers: Range<u32>,
    },
    /// `submit_store` from this client's memory blocks.
    SubmitStore {
        /// The keys.
        keys: Vec<Key>,
        /// One memory block (the client's numbering) per key.
        blocks: Vec<u32>,
    },
    /// `flush_stores`.
    FlushStores,
    /// `usage`: the handle's usage as JSON.
    Usage,
    /// `submit_store` from this client's memory blocks with each key's
    /// per-layer crc32c as the client took them (the staged GPU path
    /// gathers its blocks into this memory with their checksums): the
    /// service writes them into the headers rather than hashing the blocks.
    SubmitStoreCrcs {
        /// The keys.
        keys: Vec<Key>,
        /// One memory block (the client's numbering) per key.
        blocks: Vec<u32>,
        /// Per key, one crc32c per layer.
        crcs: Vec<Vec<u32>>,
    },
}

/// What the service sends: answers (with the request's id) and events (id 0).
#[derive(Clone, Debug)]
pub enum Response {
    /// The hello's answer; the client's shared memory file rides with it
    /// (none for a lookup-only client: `blocks`, `layer_stride` and
    /// `file_bytes` are 0).
    Welcome {
        /// The service's protocol version.
        version: u32,
        /// The pool's KV geometry.
        geometry: KvGeometry,
        /// The pool's key namespace.
        namespace: String,
        /// The model name the pool recorded at its create.
        model_name: String,
        /// Memory blocks this client may name (0..blocks).
        blocks: u32,
        /// Bytes between layer `l` and `l + 1` in the shared file: layer `l`
        /// of block `b` is at `l * layer_stride + 2 * b * object_bytes` (K,
        /// then V), the engines' block-major per-layer layout.
        layer_stride: u64,
        /// Size of the shared file.
        file_bytes: u64,
        /// The engine serving the pool.
        engine: String,
    },
    /// A count (lookups, remove).
    Count(u64),
    /// A submitted job's id.
    Job(u64),
    /// Done, nothing to say.
    Ok,
    /// The request failed; the client stays connected.
    Refused(Failure),
    /// A layer of a load is in the client's memory (or failed).
    Layer {
        /// The load.
        job: u64,
        /// The layer.
        layer: u32,
        /// Why it failed.
        error: Option<Failure>,
    },
    /// A job finished, with its result.
    Finished(JobResult),
    /// `usage`'s answer: [`crate::handle::HandleUsage`] as JSON.
    Usage(String),
}

mod kind {
    pub const HELLO: u16 = 1;
    pub const LOOKUP: u16 = 2;
    pub const LOOKUP_AND_PIN: u16 = 3;
    pub const UNPIN: u16 = 4;
    pub const REMOVE: u16 = 5;
    pub const SUBMIT_LOAD: u16 = 6;
    pub const SUBMIT_STORE: u16 = 7;
    pub const FLUSH_STORES: u16 = 8;
    pub const USAGE: u16 = 9;
    // Apart from the kinds above, so that kinds added beside it do not meet.
    pub const SUBMIT_STORE_CRCS: u16 = 0x20;
    pub const WELCOME: u16 = 0x81;
    pub const COUNT: u16 = 0x82;
    pub const JOB: u16 = 0x83;
    pub const OK: u16 = 0x84;
    pub const REFUSED: u16 = 0x85;
    pub const LAYER: u16 = 0x86;
    pub const FINISHED: u16 = 0x87;
    pub const USAGE_JSON: u16 = 0x88;
}

/// Builds a body.
#[derive(Default)]
struct Out(Vec<u8>);

impl Out {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn text(&mut self, s: &str) {
        self.text_within(s, MAX_TEXT_BYTES)
    }
    /// Text up to `max` bytes (and [`MAX_TEXT_BYTES`]); longer is cut.
    fn text_within(&mut self, s: &str, max: usize) {
        let mut end = s.len().min(MAX_TEXT_BYTES).min(max);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
    /// Text up to [`MAX_LONG_TEXT_BYTES`] (the usage report); longer is cut.
    fn long_text(&mut self, s: &str) {
        let mut end = s.len().min(MAX_LONG_TEXT_BYTES);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u32(end as u32);
        self.0.extend_from_slice(&s.as_bytes()[..end]);
    }
    fn key(&mut self, k: &Key) {
        let b = k.as_bytes();
        self.u8(b.len() as u8);
        self.0.extend_from_slice(b);
    }
    fn keys(&mut self, ks: &[Key]) {
        self.u32(ks.len() as u32);
        for k in ks {
            self.key(k);
        }
    }
    fn blocks(&mut self, bs: &[u32]) {
        self.u32(bs.len() as u32);
        for &b in bs {
            self.u32(b);
        }
    }
    fn failure(&mut self, f: &Failure) {
        self.failure_within(f, MAX_TEXT_BYTES)
    }
    fn failure_within(&mut self, f: &Failure, max_text: usize) {
        self.u8(kind_code(f.kind));
        self.text_within(&f.message, max_text);
    }
    fn opt_failure(&mut self, f: &Option<Failure>) {
        match f {
            None => self.u8(0),
            Some(f) => {
                self.u8(1);
                self.failure(f);
            }
        }
    }
}

/// Reads a body, every read bounded by what is left.
struct In<'a> {
    b: &'a [u8],
    what: &'static str,
}

impl<'a> In<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        if self.b.len() < n {
            return Err(bad(format!("a {} message ends early", self.what)));
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Ok(h)
    }
    fn u8(&mut self) -> Result<u8> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.take(4)?.try_into().expect("4")))
    }
    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.take(8)?.try_into().expect("8")))
    }
    fn text(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > MAX_TEXT_BYTES {
            return Err(bad(format!(
                "a text of {n} bytes in a {} message (at most {MAX_TEXT_BYTES})",
                self.what
            )));
        }
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn long_text(&mut self) -> Result<String> {
        let n = self.u32()? as usize;
        if n > MAX_LONG_TEXT_BYTES {
            return Err(bad(format!(
                "a text of {n} bytes in a {} message (at most {MAX_LONG_TEXT_BYTES})",
                self.what
            )));
        }
        Ok(String::from_utf8_lossy(self.take(n)?).into_owned())
    }
    fn count(&mut self) -> Result<usize> {
        let n = self.u32()? as usize;
        if n > MAX_KEYS {
            return Err(bad(format!(
                "{n} entries in a {} message (at most {MAX_KEYS})",
                self.what
            )));
        }
        Ok(n)
    }
    fn key(&mut self) -> Result<Key> {
        let n = self.u8()? as usize;
        Key::new(self.take(n)?).map_err(|e| bad(format!("in a {} message: {e}", self.what)))
    }
    fn keys(&mut self) -> Result<Vec<Key>> {
        let n = self.count()?;
        (0..n).map(|_| self.key()).collect()
    }
    fn blocks(&mut self) -> Result<Vec<u32>> {
        let n = self.count()?;
        (0..n).map(|_| self.u32()).collect()
    }
    fn failure(&mut self) -> Result<Failure> {
        let k = self.u8()?;
        let kind = kind_of(k).ok_or_else(|| bad(format!("unknown error kind {k}")))?;
        Ok(Failure::new(kind, self.text()?))
    }
    fn opt_failure(&mut self) -> Result<Option<Failure>> {
        match self.u8()? {
            0 => Ok(None),
            1 => Ok(Some(self.failure()?)),
            t => Err(bad(format!("optional tag {t} in a {} message", self.what))),
        }
    }
    fn end(self) -> Result<()> {
        if !self.b.is_empty() {
            return Err(bad(format!(
                "{} bytes past the end of a {} message",
                self.b.len(),
                self.what
            )));
        }
        Ok(())
    }
}

const KINDS: [ErrorKind; 7] = [
    ErrorKind::Usage,
    ErrorKind::Backpressure,
    ErrorKind::Io,
    ErrorKind::Corrupt,
    ErrorKind::Unsupported,
    ErrorKind::Closed,
    ErrorKind::Internal,
];

fn kind_code(k: ErrorKind) -> u8 {
    KINDS.iter().position(|&x| x == k).unwrap_or(6) as u8
}

fn kind_of(c: u8) -> Option<ErrorKind> {
    KINDS.get(c as usize).copied()
}

/// Header and body of one frame.
fn frame(kind: u16, req: u64, body: Out) -> Vec<u8> {
    debug_assert!(body.0.len() <= MAX_BODY_BYTES as usize);
    let h = Header {
        body_len: body.0.len() as u32,
        kind,
        flags: 0,
        req,
    };
    let mut v = Vec::with_capacity(HEADER_BYTES + body.0.len());
    v.extend_from_slice(&h.encode());
    v.extend_from_slice(&body.0);
    v
}

fn check_job(keys: &[Key], blocks: &[u32]) -> Result<()> {
    if keys.len() > MAX_KEYS {
        return Err(Error::invalid(format!(
            "a job of {} keys is more than the kvtier service takes in one request ({MAX_KEYS}); submit it in parts",
            keys.len()
        )));
    }
    if keys.len() != blocks.len() {
        return Err(Error::invalid(format!(
            "{} keys but {} memory blocks: give one memory block per key",
            keys.len(),
            blocks.len()
        )));
    }
    Ok(())
}

/// One checksum list per key (each the model's layers: the service checks
/// that against its pool).
fn check_crcs(keys: usize, crcs: &[Vec<u32>]) -> Result<()> {
    if crcs.len() != keys {
        return Err(Error::invalid(format!(
            "{keys} keys but {} checksum lists: give one list of per-layer crc32c per key",
            crcs.len()
        )));
    }
    Ok(())
}

impl Request {
    /// The frame of this request with id `req`. Refuses a request the
    /// service could not take (too many keys).
    pub fn encode(&self, req: u64) -> Result<Vec<u8>> {
        let mut o = Out::default();
        let many = |ks: &[Key]| -> Result<()> {
            if ks.len() > MAX_KEYS {
                return Err(Error::invalid(format!(
                    "{} keys in one call is more than the kvtier service takes ({MAX_KEYS}); split the call",
                    ks.len()
                )));
            }
            Ok(())
        };
        let kind = match self {
            Request::Hello {
                version,
                blocks,
                kind: client,
            } => {
                o.0.extend_from_slice(&MAGIC);
                o.u32(*version);
                o.u32(*blocks);
                o.u32(client.code());
                kind::HELLO
            }
            Request::Lookup(ks) => {
                many(ks)?;
                o.keys(ks);
                kind::LOOKUP
            }
            Request::LookupAndPin(ks) => {
                many(ks)?;
                o.keys(ks);
                kind::LOOKUP_AND_PIN
            }
            Request::Unpin(ks) => {
                many(ks)?;
                o.keys(ks);
                kind::UNPIN
            }
            Request::Remove(ks) => {
                many(ks)?;
                o.keys(ks);
                kind::REMOVE
            }
            Request::SubmitLoad {
                keys,
                blocks,
                layers,
            } => {
                check_job(keys, blocks)?;
                o.keys(keys);
                o.blocks(blocks);
                o.u32(layers.start);
                o.u32(layers.end);
                kind::SUBMIT_LOAD
            }
            Request::SubmitStore { keys, blocks } => {
                check_job(keys, blocks)?;
                o.keys(keys);
                o.blocks(blocks);
                kind::SUBMIT_STORE
            }
            Request::FlushStores => kind::FLUSH_STORES,
            Request::Usage => kind::USAGE,
            Request::SubmitStoreCrcs { keys, blocks, crcs } => {
                check_job(keys, blocks)?;
                check_crcs(keys.len(), crcs)?;
                o.keys(keys);
                o.blocks(blocks);
                for c in crcs {
                    o.blocks(c);
                }
                if o.0.len() > MAX_BODY_BYTES as usize {
                    return Err(Error::invalid(format!(
                        "a store of {} keys with their checksums is more than one request carries ({MAX_BODY_BYTES} bytes); split the store",
                        keys.len()
                    )));
                }
                kind::SUBMIT_STORE_CRCS
            }
        };
        Ok(frame(kind, req, o))
    }

    /// Parses a request body of `kind`.
    pub fn decode(kind: u16, body: &[u8]) -> Result<Request> {
        let mut i = In {
            b: body,
            what: "request",
        };
        let r = match kind {
            kind::HELLO => {
                let magic = i.take(MAGIC.len())?;
                if magic != MAGIC {
                    return Err(bad(
                        "the first frame is not a kvtier hello (wrong magic): is this client speaking to the right socket?",
                    ));
                }
                // The version before anything else: the rest of a hello
                // of another version may be laid out differently.
                let version = i.u32()?;
                if version != VERSION {
                    return Err(bad(version_mismatch(version, VERSION)));
                }
                let blocks = i.u32()?;
                let code = i.u32()?;
                let kind = ClientKind::of(code)
                    .ok_or_else(|| bad(format!("unknown client kind {code} in a hello")))?;
                if kind == ClientKind::LookupOnly && blocks != 0 {
                    return Err(bad(format!(
                        "a lookup-only hello asks for {blocks} memory blocks; a lookup-only client shares no memory (ask for 0, or connect as a client with memory)"
                    )));
                }
                Request::Hello {
                    version,
                    blocks,
                    kind,
                }
            }
            kind::LOOKUP => Request::Lookup(i.keys()?),
            kind::LOOKUP_AND_PIN => Request::LookupAndPin(i.keys()?),
            kind::UNPIN => Request::Unpin(i.keys()?),
            kind::REMOVE => Request::Remove(i.keys()?),
            kind::SUBMIT_LOAD => {
                let keys = i.keys()?;
                let blocks = i.blocks()?;
                let layers = i.u32()?..i.u32()?;
                check_job(&keys, &blocks).map_err(|e| bad(e.to_string()))?;
                Request::SubmitLoad {
                    keys,
                    blocks,
                    layers,
                }
            }
            kind::SUBMIT_STORE => {
                let keys = i.keys()?;
                let blocks = i.blocks()?;
                check_job(&keys, &blocks).map_err(|e| bad(e.to_string()))?;
                Request::SubmitStore { keys, blocks }
            }
            kind::FLUSH_STORES => Request::FlushStores,
            kind::USAGE => Request::Usage,
            kind::SUBMIT_STORE_CRCS => {
                let keys = i.keys()?;
                let blocks = i.blocks()?;
                check_job(&keys, &blocks).map_err(|e| bad(e.to_string()))?;
                let crcs = (0..keys.len())
                    .map(|_| i.blocks())
                    .collect::<Result<Vec<_>>>()?;
                Request::SubmitStoreCrcs { keys, blocks, crcs }
            }
            k => return Err(bad(format!("unknown request kind {k:#x}"))),
        };
        i.end()?;
        Ok(r)
    }
}

fn job_kind_code(k: JobKind) -> u8 {
    match k {
        JobKind::Load => 0,
        JobKind::Store => 1,
    }
}

impl Response {
    /// The frame of this response (`req` 0 for events).
    pub fn encode(&self, req: u64) -> Vec<u8> {
        let mut o = Out::default();
        let kind = match self {
            Response::Welcome {
                version,
                geometry,
                namespace,
                model_name,
                blocks,
                layer_stride,
                file_bytes,
                engine,
            } => {
                o.u32(*version);
                o.u32(geometry.layers);
                o.u32(geometry.kv_heads);
                o.u32(geometry.head_dim);
                o.u32(geometry.dtype.code());
                o.u32(geometry.block_size);
                o.text(namespace);
                o.text(model_name);
                o.u32(*blocks);
                o.u64(*layer_stride);
                o.u64(*file_bytes);
                o.text(engine);
                kind::WELCOME
            }
            Response::Count(n) => {
                o.u64(*n);
                kind::COUNT
            }
            Response::Job(j) => {
                o.u64(*j);
                kind::JOB
            }
            Response::Ok => kind::OK,
            Response::Refused(f) => {
                o.failure(f);
                kind::REFUSED
            }
            Response::Layer { job, layer, error } => {
                o.u64(*job);
                o.u32(*layer);
                o.opt_failure(error);
                kind::LAYER
            }
            Response::Finished(r) => {
                // Evictions past the bound are not worth a dropped client:
                // they only feed the engine's KV events.
                let ev = &r.evicted[..r.evicted.len().min(MAX_KEYS)];
                // A job of many keys that all failed with long messages
                // (up to MAX_KEYS x MAX_TEXT_BYTES) would not fit a frame:
                // the failures share what the rest leaves of one.
                let key_bytes =
                    |ks: &[Key]| 4 + ks.iter().map(|k| 1 + k.as_bytes().len()).sum::<usize>();
                let failures = r
                    .outcomes
                    .iter()
                    .filter(|o| matches!(o, KeyOutcome::Failed(_) | KeyOutcome::Corrupt(_)))
                    .count();
                let fixed = 8
                    + 1
                    + key_bytes(&r.keys)
                    + r.outcomes.len()
                    + failures * (1 + 4)
                    + key_bytes(ev);
                let per_text = (MAX_BODY_BYTES as usize).saturating_sub(fixed) / failures.max(1);
                o.u64(r.job);
                o.u8(job_kind_code(r.kind));
                o.keys(&r.keys);
                for out in &r.outcomes {
                    match out {
                        KeyOutcome::Done => o.u8(0),
                        KeyOutcome::AlreadyStored => o.u8(1),
                        KeyOutcome::Failed(f) => {
                            o.u8(2);
                            o.failure_within(f, per_text);
                        }
                        KeyOutcome::Corrupt(f) => {
                            o.u8(3);
                            o.failure_within(f, per_text);
                        }
                    }
                }
                o.keys(ev);
                kind::FINISHED
            }
            Response::Usage(json) => {
                o.long_text(json);
                kind::USAGE_JSON
            }
        };
        frame(kind, req, o)
    }

    /// Parses a response body of `kind`.
    pub fn decode(kind: u16, body: &[u8]) -> Result<Response> {
        let mut i = In {
            b: body,
            what: "response",
        };
        let r = match kind {
            kind::WELCOME => {
                // The version first: a welcome of another version may be
                // laid out differently.
                let version = i.u32()?;
                if version != VERSION {
                    return Err(bad(version_mismatch(VERSION, version)));
                }
                let layers = i.u32()?;
                let kv_heads = i.u32()?;
                let head_dim = i.u32()?;
                let code = i.u32()?;
                let dtype =
                    DType::from_code(code).ok_or_else(|| bad(format!("unknown dtype {code}")))?;
                let block_size = i.u32()?;
                Response::Welcome {
                    version,
                    geometry: KvGeometry {
                        layers,
                        kv_heads,
                        head_dim,
                        dtype,
                        block_size,
                    },
                    namespace: i.text()?,
                    model_name: i.text()?,
                    blocks: i.u32()?,
                    layer_stride: i.u64()?,
                    file_bytes: i.u64()?,
                    engine: i.text()?,
                }
            }
            kind::COUNT => Response::Count(i.u64()?),
            kind::JOB => Response::Job(i.u64()?),
            kind::OK => Response::Ok,
            kind::REFUSED => Response::Refused(i.failure()?),
            kind::LAYER => Response::Layer {
                job: i.u64()?,
                layer: i.u32()?,
                error: i.opt_failure()?,
            },
            kind::FINISHED => {
                let job = i.u64()?;
                let kind = match i.u8()? {
                    0 => JobKind::Load,
                    1 => JobKind::Store,
                    k => return Err(bad(format!("unknown job kind {k}"))),
                };
                let keys = i.keys()?;
                let outcomes = (0..keys.len())
                    .map(|_| {
                        Ok(match i.u8()? {
                            0 => KeyOutcome::Done,
                            1 => KeyOutcome::AlreadyStored,
                            2 => KeyOutcome::Failed(i.failure()?),
                            3 => KeyOutcome::Corrupt(i.failure()?),
                            t => return Err(bad(format!("unknown key outcome {t}"))),
                        })
                    })
                    .collect::<Result<Vec<_>>>()?;
                let evicted = i.keys()?;
                Response::Finished(JobResult {
                    job,
                    kind,
                    keys,
                    outcomes,
                    evicted,
                })
            }
            kind::USAGE_JSON => Response::Usage(i.long_text()?),
            k => return Err(bad(format!("unknown response kind {k:#x}"))),
        };
        i.end()?;
        Ok(r)
    }
}

/// Reads one frame from `r`: the header (bounded), then the body.
/// `Ok(None)` at a clean end of stream before a header.
pub fn read_frame(r: &mut impl std::io::Read) -> Result<Option<(Header, Vec<u8>)>> {
    let Some(h) = read_header(r)? else {
        return Ok(None);
    };
    Ok(Some((h, read_body(r, &h)?)))
}

/// Reads and bounds one header; `Ok(None)` at a clean end of stream.
pub fn read_header(r: &mut impl std::io::Read) -> Result<Option<Header>> {
    let mut hb = [0u8; HEADER_BYTES];
    let mut got = 0;
    while got < HEADER_BYTES {
        match r.read(&mut hb[got..]) {
            Ok(0) if got == 0 => return Ok(None),
            Ok(0) => return Err(bad("the stream ended inside a frame header")),
            Ok(n) => got += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e)
                if got > 0
                    && matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
            {
                return Err(bad(format!(
                    "a frame's header did not arrive in time ({got} of its {HEADER_BYTES} bytes came)"
                )))
            }
            Err(e) => return Err(Error::io("reading a kvtier service frame", e)),
        }
    }
    Header::decode(&hb).map(Some)
}

/// Reads the body `h` announces (at most [`MAX_BODY_BYTES`]).
pub fn read_body(r: &mut impl std::io::Read, h: &Header) -> Result<Vec<u8>> {
    let mut body = vec![0u8; h.body_len as usize];
    r.read_exact(&mut body).map_err(|e| match e.kind() {
        std::io::ErrorKind::UnexpectedEof => bad("the stream ended inside a frame body"),
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => bad(format!(
            "a frame's body ({} bytes) did not arrive in time after its header",
            h.body_len
        )),
        _ => Error::io("reading a kvtier service frame", e),
    })?;
    Ok(body)
}

/// Whether `e` is the peer going away rather than a bad frame.
pub fn is_disconnect(e: &Error) -> bool {
    matches!(e, Error::Io { .. }) || e.kind() == ErrorKind::Closed
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip_req(r: Request) {
        let f = r.encode(7).unwrap();
        let h = Header::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert_eq!(h.req, 7);
        assert_eq!(h.body_len as usize, f.len() - HEADER_BYTES);
        assert_eq!(Request::decode(h.kind, &f[HEADER_BYTES..]).unwrap(), r);
    }

    fn round_trip_resp(r: Response) {
        let f = r.encode(3);
        let h = Header::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        let back = Response::decode(h.kind, &f[HEADER_BYTES..]).unwrap();
        assert_eq!(format!("{back:?}"), format!("{r:?}"));
    }

    #[test]
    fn every_message_round_trips() {
        let ks = vec![Key::from_u64(1), Key::new(&[9; 32]).unwrap()];
        round_trip_req(Request::Hello {
            version: VERSION,
            blocks: 12,
            kind: ClientKind::Memory,
        });
        round_trip_req(Request::Hello {
            version: VERSION,
            blocks: 0,
            kind: ClientKind::LookupOnly,
        });
        round_trip_req(Request::Lookup(ks.clone()));
        round_trip_req(Request::LookupAndPin(ks.clone()));
        round_trip_req(Request::Unpin(ks.clone()));
        round_trip_req(Request::Remove(vec![]));
        round_trip_req(Request::SubmitLoad {
            keys: ks.clone(),
            blocks: vec![3, 4],
            layers: 1..3,
        });
        round_trip_req(Request::SubmitStore {
            keys: ks.clone(),
            blocks: vec![0, 1],
        });
        round_trip_req(Request::FlushStores);
        round_trip_req(Request::Usage);
        round_trip_req(Request::SubmitStoreCrcs {
            keys: vec![Key::from_u64(7), Key::from_u64(8)],
            blocks: vec![3, 4],
            crcs: vec![vec![1, 2, 3], vec![4, 5, 6]],
        });
        round_trip_resp(Response::Usage("{\"tier\": {}}".into()));
        round_trip_resp(Response::Welcome {
            version: VERSION,
            geometry: KvGeometry {
                layers: 4,
                kv_heads: 2,
                head_dim: 64,
                dtype: DType::BF16,
                block_size: 16,
            },
            namespace: "tiny/bf16/bs16/tp0".into(),
            model_name: "tiny".into(),
            blocks: 8,
            layer_stride: 1 << 20,
            file_bytes: 4 << 20,
            engine: "uring".into(),
        });
        round_trip_resp(Response::Count(5));
        round_trip_resp(Response::Job(9));
        round_trip_resp(Response::Ok);
        round_trip_resp(Response::Refused(Failure::new(
            ErrorKind::Backpressure,
            "full",
        )));
        round_trip_resp(Response::Layer {
            job: 2,
            layer: 1,
            error: Some(Failure::new(ErrorKind::Io, "bad read")),
        });
        round_trip_resp(Response::Finished(JobResult {
            job: 4,
            kind: JobKind::Store,
            keys: ks.clone(),
            outcomes: vec![
                KeyOutcome::Done,
                KeyOutcome::Corrupt(Failure::new(ErrorKind::Corrupt, "crc")),
            ],
            evicted: vec![Key::from_u64(77)],
        }));
    }

    /// A job of the most keys a request may name, every one failed with a
    /// message of the longest text: the result still fits one frame (the
    /// messages cut to share it) and decodes. It came to ~270 MiB, past
    /// the frame bound: a debug assertion in the service's dispatcher (every
    /// client's waits hung) and a dropped client in release builds.
    #[test]
    fn the_largest_failed_job_fits_one_frame() {
        let keys: Vec<Key> = (0..MAX_KEYS as u64)
            .map(|k| { let mut b = [7u8; 32]; b[..8].copy_from_slice(&k.to_le_bytes()); Key::new(&b).unwrap() })
            .collect();
        let long = "x".repeat(MAX_TEXT_BYTES + 100);
        let r = Response::Finished(JobResult {
            job: 9,
            kind: JobKind::Load,
            keys: keys.clone(),
            outcomes: (0..keys.len())
                .map(|i| {
                    let f = Failure::new(ErrorKind::Corrupt, long.clone());
                    if i % 2 == 0 {
                        KeyOutcome::Corrupt(f)
                    } else {
                        KeyOutcome::Failed(f)
                    }
                })
                .collect(),
            evicted: keys.clone(),
        });
        let f = r.encode(5);
        let h = Header::decode(f[..HEADER_BYTES].try_into().unwrap()).unwrap();
        assert!(h.body_len <= MAX_BODY_BYTES);
        match Response::decode(h.kind, &f[HEADER_BYTES..]).unwrap() {
            Response::Finished(back) => {
                assert_eq!(back.keys, keys);
                assert_eq!(back.evicted, keys);
                assert!(back.outcomes.iter().all(|o| match o {
                    KeyOutcome::Corrupt(f) | KeyOutcome::Failed(f) =>
                        !f.message.is_empty() && f.message.len() < MAX_TEXT_BYTES,
                    _ => false,
                }));
            }
            other => panic!("{other:?}"),
        }
        // A small job keeps its messages whole.
        round_trip_resp(Response::Finished(JobResult {
            job: 1,
            kind: JobKind::Load,
            keys: vec![Key::from_u64(1)],
            outcomes: vec![KeyOutcome::Failed(Failure::new(ErrorKind::Io, long[..MAX_TEXT_BYTES].to_string()))],
            evicted: vec![],
        }));
    }

    #[test]
    fn bad_frames_are_refused_with_their_reason() {
        let mut h = Header {
            body_len: MAX_BODY_BYTES + 1,
            kind: 2,
            flags: 0,
            req: 1,
        };
        let e = Header::decode(&h.encode()).unwrap_err();
        assert!(e.to_string().contains("larger than"), "{e}");
        h.body_len = 0;
        h.flags = 1;
        assert!(Header::decode(&h.encode()).is_err());
        let e = Request::decode(0x7777, &[]).unwrap_err();
        assert!(e.to_string().contains("unknown request kind"), "{e}");
        let mut hello = Request::Hello {
            version: VERSION,
            blocks: 1,
            kind: ClientKind::Memory,
        }
        .encode(1)
        .unwrap();
        hello[HEADER_BYTES] = b'X';
        let e = Request::decode(kind::HELLO, &hello[HEADER_BYTES..]).unwrap_err();
        assert!(e.to_string().contains("wrong magic"), "{e}");
        let mut old = Out::default();
        old.0.extend_from_slice(&MAGIC);
        old.u32(VERSION + 1);
        old.u32(0);
        let e = Request::decode(kind::HELLO, &old.0).unwrap_err();
        assert!(e.to_string().contains("protocol version"), "{e}");
        // A version-1 hello (magic, version, blocks: no client kind) is
        // refused by its version, naming both and the fix.
        let mut v1 = Out::default();
        v1.0.extend_from_slice(&MAGIC);
        v1.u32(1);
        v1.u32(0);
        let e = Request::decode(kind::HELLO, &v1.0).unwrap_err().to_string();
        assert!(
            e.contains("version 1") && e.contains(&format!("version {VERSION}")),
            "{e}"
        );
        assert!(e.contains("one kvtier release"), "{e}");
        // A welcome of another version is refused by the client the same way.
        let mut w = Out::default();
        w.u32(1);
        w.u32(4);
        let e = Response::decode(kind::WELCOME, &w.0).unwrap_err().to_string();
        assert!(
            e.contains("version 1") && e.contains(&format!("version {VERSION}")),
            "{e}"
        );
        // A client kind this version does not define; memory asked by a
        // lookup-only client.
        let mut odd = Out::default();
        odd.0.extend_from_slice(&MAGIC);
        odd.u32(VERSION);
        odd.u32(0);
        odd.u32(9);
        let e = Request::decode(kind::HELLO, &odd.0).unwrap_err();
        assert!(e.to_string().contains("client kind 9"), "{e}");
        let f = Request::Hello {
            version: VERSION,
            blocks: 4,
            kind: ClientKind::LookupOnly,
        }
        .encode(1)
        .unwrap();
        let e = Request::decode(kind::HELLO, &f[HEADER_BYTES..]).unwrap_err();
        assert!(e.to_string().contains("lookup-only"), "{e}");
        // A count past the bound is refused before anything is allocated.
        let mut many = Out::default();
        many.u32(u32::MAX);
        let e = Request::decode(kind::LOOKUP, &many.0).unwrap_err();
        assert!(e.to_string().contains("at most"), "{e}");
        // Truncated and trailing bytes.
        let f = Request::Lookup(vec![Key::from_u64(1)]).encode(1).unwrap();
        assert!(Request::decode(kind::LOOKUP, &f[HEADER_BYTES..f.len() - 1]).is_err());
        let mut long = f[HEADER_BYTES..].to_vec();
        long.push(0);
        assert!(Request::decode(kind::LOOKUP, &long).is_err());
        // Keys and blocks that disagree.
        let mut o = Out::default();
        o.keys(&[Key::from_u64(1)]);
        o.blocks(&[1, 2]);
        o.u32(0);
        o.u32(1);
        assert!(Request::decode(kind::SUBMIT_LOAD, &o.0).is_err());
    }
}
