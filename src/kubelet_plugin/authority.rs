//! Makes the plugin's sockets answer every conforming gRPC client, whatever `:authority` it sends.
//!
//! A unix socket has no host, so each gRPC implementation makes up an authority of its own, and the HTTP/2 server
//! under tonic (h2) answers every request whose `:authority` is not a valid RFC 3986 authority with a stream reset
//! (`RST_STREAM`, `PROTOCOL_ERROR`): it parses the value as an `http::uri::Authority`, which refuses
//!
//! - the percent-encoded socket path (`%2Fvar%2Flib%2F…`): grpc core ≥ 1.57 (grpc-python, C++, Ruby…) for
//!   `unix:` targets, and grpc-go dialing through a custom dialer (passthrough), as the kubelet's plugin watcher
//!   dials the registration socket;
//! - the raw path (`/var/lib/…`): grpc-java, older grpc-go, other clients with a custom dialer;
//! - an empty value: clients that know no name for the target.
//!
//! (`%` is allowed only in the user-info or an IPv6 zone, `/`, `?` and `#` end an authority; kubernetes#109081,
//! hyperium/h2#487, grpc/grpc#38142.) Only grpc-go's `unix:` resolver sends a valid one (`localhost`), which is why
//! the kubelet's DRA manager, dialing `unix:<path>`, never saw the problem while grpc-python did.
//!
//! The authority means nothing on a unix socket, so every connection on either socket passes through [`incoming`]:
//! each header block the client sends is decoded (HPACK, with the client's dynamic table) and re-encoded with
//! `:authority: localhost` for h2; every other frame, and everything h2 sends back, passes through byte for byte.

use std::io;

use loona_hpack::{Decoder, Encoder};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, DuplexStream};
use tokio::net::{UnixListener, UnixStream};
use tokio_stream::wrappers::UnixListenerStream;
use tokio_stream::{Stream, StreamExt as _};
use tracing::debug;

/// The client connection preface (RFC 9113 §3.4).
const PREFACE: &[u8; 24] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const HEADERS: u8 = 0x1;
const CONTINUATION: u8 = 0x9;
const END_STREAM: u8 = 0x1;
const END_HEADERS: u8 = 0x4;
const PADDED: u8 = 0x8;
const PRIORITY: u8 = 0x20;
/// The largest frame payload every HTTP/2 peer accepts (SETTINGS_MAX_FRAME_SIZE's initial value): re-encoded
/// blocks are cut to it.
const MAX_FRAME: usize = 16_384;
/// A header block larger than this is not a plugin call: refuse rather than buffer without end.
const MAX_BLOCK: usize = 1 << 20;
/// The most a header block may decode to (RFC 9113 §6.5.2 size: names, values and 32 bytes per field). A few bytes
/// of HPACK can stand for kilobytes (each one-byte index repeats a table entry), so a block within [`MAX_BLOCK`]
/// could otherwise decode to gigabytes.
const MAX_HEADER_LIST: usize = 1 << 20;
/// The dynamic table h2 announces (SETTINGS_HEADER_TABLE_SIZE, HPACK's default): a client's size update above it
/// is refused.
const MAX_TABLE: usize = 4096;
/// What h2 accepts as the authority of a call over a unix socket.
const AUTHORITY: &[u8] = b"localhost";

/// The connections accepted on `listener`, each one as [`filtered`] hands it to tonic.
pub(super) fn incoming(listener: UnixListener) -> impl Stream<Item = io::Result<DuplexStream>> {
    UnixListenerStream::new(listener).map(|connection| connection.map(filtered))
}

/// Hands tonic a connection whose client header blocks carry a valid `:authority`; the copying runs in the
/// background until either side closes.
fn filtered(client: UnixStream) -> DuplexStream {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    tokio::spawn(async move {
        let (mut client_read, mut client_write) = client.into_split();
        let (mut server_read, mut server_write) = tokio::io::split(theirs);
        let upstream = tokio::spawn(async move {
            if let Err(e) = rewrite(&mut client_read, &mut server_write).await {
                debug!(error = %e, "plugin connection ended");
            }
            let _ = server_write.shutdown().await;
        });
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
        upstream.abort();
    });
    ours
}

/// Copies an HTTP/2 client's byte stream from `from` to `to`, re-encoding header blocks (see the module docs).
async fn rewrite<R, W>(from: &mut R, to: &mut W) -> io::Result<()>
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    let mut preface = [0u8; PREFACE.len()];
    from.read_exact(&mut preface).await?;
    to.write_all(&preface).await?;
    let mut blocks = BlockRewriter::default();
    loop {
        let mut header = [0u8; 9];
        match from.read_exact(&mut header).await {
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(()),
            other => other?,
        };
        let length = u32::from_be_bytes([0, header[0], header[1], header[2]]) as usize;
        // h2 announces no larger frames (SETTINGS_MAX_FRAME_SIZE), and refuses them itself: checked before the
        // payload is allocated.
        if length > MAX_FRAME {
            return Err(invalid("frame larger than SETTINGS_MAX_FRAME_SIZE"));
        }
        let mut payload = vec![0u8; length];
        from.read_exact(&mut payload).await?;
        let frame = Frame { kind: header[3], flags: header[4], stream: header[5..9].try_into().unwrap_or_default() };
        match blocks.frame(&frame, &payload)? {
            Some(rewritten) => to.write_all(&rewritten).await?,
            None if matches!(frame.kind, HEADERS | CONTINUATION) => {}
            None => {
                to.write_all(&header).await?;
                to.write_all(&payload).await?;
            }
        }
        to.flush().await?;
    }
}

#[derive(Debug)]
struct Frame {
    kind: u8,
    flags: u8,
    stream: [u8; 4],
}

/// Collects a header block (HEADERS plus CONTINUATIONs) and re-encodes it once complete.
struct BlockRewriter {
    decoder: Decoder<'static>,
    encoder: Encoder<'static>,
    /// The block being collected: its HEADERS frame's END_STREAM flag, stream, and fragments so far.
    pending: Option<(u8, [u8; 4], Vec<u8>)>,
}

impl Default for BlockRewriter {
    fn default() -> Self {
        let mut decoder = Decoder::new();
        decoder.set_max_allowed_table_size(MAX_TABLE);
        Self { decoder, encoder: Encoder::new(), pending: None }
    }
}

impl BlockRewriter {
    /// `Some(frames)` when `frame` completed a header block; `None` for frames passed through or still collecting.
    fn frame(&mut self, frame: &Frame, payload: &[u8]) -> io::Result<Option<Vec<u8>>> {
        match frame.kind {
            HEADERS => {
                let fragment = headers_fragment(frame.flags, payload)?;
                self.pending = Some((frame.flags & END_STREAM, frame.stream, fragment.to_vec()));
            }
            CONTINUATION => match &mut self.pending {
                Some((_, _, block)) if block.len() + payload.len() <= MAX_BLOCK => block.extend_from_slice(payload),
                Some(_) => return Err(invalid("header block too large")),
                None => return Err(invalid("CONTINUATION without HEADERS")),
            },
            _ => return Ok(None),
        }
        if frame.flags & END_HEADERS == 0 {
            return Ok(None);
        }
        let Some((end_stream, stream, block)) = self.pending.take() else { return Ok(None) };
        let mut headers = Vec::new();
        let mut size = 0usize;
        self.decoder
            .decode_with_cb(&block, |name, value| {
                size = size.saturating_add(name.len() + value.len() + 32);
                if size <= MAX_HEADER_LIST {
                    headers.push((name.into_owned(), value.into_owned()));
                }
            })
            .map_err(|e| invalid(&format!("HPACK: {e:?}")))?;
        if size > MAX_HEADER_LIST {
            return Err(invalid("header list larger than 1 MiB decoded"));
        }
        let headers = headers.iter().map(|(name, value)| {
            let value = if name.as_slice() == b":authority" { AUTHORITY } else { value.as_slice() };
            (name.as_slice(), value)
        });
        let block = self.encoder.encode(headers);
        Ok(Some(frames(end_stream, stream, &block)))
    }
}

/// The header block fragment of a HEADERS payload, without padding and priority fields.
fn headers_fragment(flags: u8, payload: &[u8]) -> io::Result<&[u8]> {
    let (mut start, mut end) = (0, payload.len());
    if flags & PADDED != 0 {
        let pad = *payload.first().ok_or_else(|| invalid("PADDED HEADERS without pad length"))? as usize;
        start = 1;
        end = end.checked_sub(pad).ok_or_else(|| invalid("padding longer than the frame"))?;
    }
    if flags & PRIORITY != 0 {
        start += 5;
    }
    payload.get(start..end).ok_or_else(|| invalid("HEADERS frame too short"))
}

/// One HEADERS frame, plus CONTINUATIONs when the block exceeds [`MAX_FRAME`].
fn frames(end_stream: u8, stream: [u8; 4], block: &[u8]) -> Vec<u8> {
    let chunks: Vec<&[u8]> = if block.is_empty() { vec![block] } else { block.chunks(MAX_FRAME).collect() };
    let mut out = Vec::with_capacity(block.len() + 9 * chunks.len());
    for (i, chunk) in chunks.iter().enumerate() {
        let kind = if i == 0 { HEADERS } else { CONTINUATION };
        let mut flags = if i == 0 { end_stream } else { 0 };
        if i + 1 == chunks.len() {
            flags |= END_HEADERS;
        }
        let length = (chunk.len() as u32).to_be_bytes();
        out.extend_from_slice(&[length[1], length[2], length[3], kind, flags]);
        out.extend_from_slice(&stream);
        out.extend_from_slice(chunk);
    }
    out
}

fn invalid(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, what.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, payload: &[u8]) -> Vec<u8> {
        frames_raw(kind, flags, [0, 0, 0, 1], payload)
    }

    fn frames_raw(kind: u8, flags: u8, stream: [u8; 4], payload: &[u8]) -> Vec<u8> {
        let length = (payload.len() as u32).to_be_bytes();
        let mut out = vec![length[1], length[2], length[3], kind, flags];
        out.extend_from_slice(&stream);
        out.extend_from_slice(payload);
        out
    }

    /// What grpc-go sends for the kubelet's GetInfo: the escaped socket path as authority, then the same header
    /// again on a second call (now an index into the dynamic table).
    fn kubelet_request(encoder: &mut Encoder<'_>) -> Vec<u8> {
        encoder.encode([
            (&b":method"[..], &b"POST"[..]),
            (b":scheme", b"http"),
            (b":path", b"/pluginregistration.Registration/GetInfo"),
            (b":authority", b"%2Fvar%2Flib%2Fkubelet%2Fplugins_registry%2Fgpu.gpu-dra.dev-reg.sock"),
            (b"content-type", b"application/grpc"),
        ])
    }

    async fn run(input: Vec<u8>) -> io::Result<Vec<u8>> {
        let mut output = Vec::new();
        rewrite(&mut input.as_slice(), &mut output).await?;
        Ok(output)
    }

    /// Splits `bytes` (after the preface) into (kind, flags, payload) frames.
    fn parse(bytes: &[u8]) -> Vec<(u8, u8, Vec<u8>)> {
        let mut rest = &bytes[PREFACE.len()..];
        let mut frames = Vec::new();
        while rest.len() >= 9 {
            let length = u32::from_be_bytes([0, rest[0], rest[1], rest[2]]) as usize;
            frames.push((rest[3], rest[4], rest[9..9 + length].to_vec()));
            rest = &rest[9 + length..];
        }
        frames
    }

    /// The rule h2 applies to a request's `:authority` (it parses an `http::uri::Authority` and resets the stream
    /// on failure), for what each client sends on a unix socket: the values the filter must replace.
    #[test]
    fn what_clients_send_and_what_h2_accepts() {
        for (sender, authority, accepted) in [
            ("grpc-go unix: resolver (the kubelet's DRA manager)", &b"localhost"[..], true),
            (
                "grpc core unix: target (grpc-python), grpc-go custom dialer",
                b"%2Ftmp%2Fp%2Fgpu.gpu-dra.dev%2Fdra.sock",
                false,
            ),
            ("grpc-java, clients with a custom dialer", b"/tmp/p/gpu.gpu-dra.dev/dra.sock", false),
            ("a client that knows no name", b"", false),
            ("what the filter sends instead", AUTHORITY, true),
        ] {
            let parsed = http::uri::Authority::try_from(authority);
            assert_eq!(parsed.is_ok(), accepted, "{sender}: {:?}", String::from_utf8_lossy(authority));
        }
    }

    #[tokio::test]
    async fn the_authority_becomes_localhost_and_everything_else_is_kept() -> io::Result<()> {
        let mut client = Encoder::new();
        let first = kubelet_request(&mut client);
        let second = kubelet_request(&mut client);
        let data = frame(0x0, END_STREAM, b"\0\0\0\0\0");
        // The first block split over HEADERS (padded, with priority) and a CONTINUATION.
        let (head, tail) = first.split_at(7);
        let mut padded = vec![3];
        padded.extend_from_slice(&[0, 0, 0, 0, 16]);
        padded.extend_from_slice(head);
        padded.extend_from_slice(&[0, 0, 0]);
        let mut input = PREFACE.to_vec();
        input.extend(frame(HEADERS, PADDED | PRIORITY, &padded));
        input.extend(frame(CONTINUATION, END_HEADERS, tail));
        input.extend(&data);
        input.extend(frame(HEADERS, END_HEADERS | END_STREAM, &second));

        let output = run(input).await?;
        assert!(output.starts_with(PREFACE));
        let frames = parse(&output);
        assert_eq!(frames.len(), 3, "{frames:?}");
        let mut server = Decoder::new();
        for (i, (kind, flags, payload)) in [&frames[0], &frames[2]].into_iter().enumerate() {
            assert_eq!(*kind, HEADERS);
            assert_eq!(*flags, if i == 0 { END_HEADERS } else { END_HEADERS | END_STREAM });
            let headers = server.decode(payload).map_err(|e| invalid(&e.to_string()))?;
            let authority = headers.iter().find(|(n, _)| n == b":authority").map(|(_, v)| v.as_slice());
            assert_eq!(authority, Some(AUTHORITY));
            let path = headers.iter().find(|(n, _)| n == b":path").map(|(_, v)| v.as_slice());
            assert_eq!(path, Some(&b"/pluginregistration.Registration/GetInfo"[..]));
        }
        assert_eq!(&output[PREFACE.len() + 9 + frames[0].2.len()..][..data.len()], &data[..]);
        Ok(())
    }

    #[tokio::test]
    async fn large_blocks_are_cut_into_continuations() -> io::Result<()> {
        let mut client = Encoder::new();
        let big = vec![b'x'; 40_000];
        let block = client.encode([(&b":path"[..], &b"/a"[..]), (b"x-big", &big)]);
        let mut input = PREFACE.to_vec();
        let mut chunks = block.chunks(MAX_FRAME).peekable();
        let mut kind = HEADERS;
        while let Some(chunk) = chunks.next() {
            input.extend(frame(kind, if chunks.peek().is_none() { END_HEADERS } else { 0 }, chunk));
            kind = CONTINUATION;
        }
        let frames = parse(&run(input).await?);
        let kinds: Vec<_> = frames.iter().map(|(k, f, p)| (*k, *f, p.len() <= MAX_FRAME)).collect();
        assert_eq!(
            kinds,
            [(HEADERS, 0, true), (CONTINUATION, 0, true), (CONTINUATION, END_HEADERS, true)],
            "three frames of at most {MAX_FRAME} bytes"
        );
        Ok(())
    }

    /// A local client (root, or a pod given the kubelet's plugin directories) must not make the agent allocate
    /// without bound: a frame larger than announced, a table larger than announced, and a block of one-byte
    /// references to a 4 KiB table entry (8 KiB of HPACK standing for 32 MiB) each end the connection.
    #[tokio::test]
    async fn a_header_block_that_decodes_without_bound_ends_the_connection() {
        let oversized = frame(0x0, 0, &vec![0; MAX_FRAME + 1]);
        let table = frame(HEADERS, END_HEADERS, &[0x3f, 0xe1, 0xff, 0x03, 0x82]);
        // A literal with incremental indexing (new name) of 4,000 bytes, then index 62 (that entry) over and over.
        let mut entry = vec![0x40, 0x01, b'x', 0x7f];
        let mut rest = 4000 - 127;
        while rest >= 128 {
            entry.push(0x80 | (rest % 128) as u8);
            rest /= 128;
        }
        entry.push(rest as u8);
        entry.extend(vec![b'v'; 4000]);
        let mut bomb = frame(HEADERS, 0, &entry);
        for last in [false, true] {
            bomb.extend(frame(CONTINUATION, if last { END_HEADERS } else { 0 }, &[0xbe; 4096]));
        }
        for (what, bad) in [("oversized frame", oversized), ("table size", table), ("decoded size", bomb)] {
            let mut input = PREFACE.to_vec();
            input.extend(bad);
            assert!(run(input).await.is_err(), "{what}");
        }
    }

    #[tokio::test]
    async fn malformed_input_ends_the_connection() {
        for bad in [frame(CONTINUATION, END_HEADERS, b"x"), frame(HEADERS, PADDED | END_HEADERS, &[9, 1])] {
            let mut input = PREFACE.to_vec();
            input.extend(bad);
            assert!(run(input).await.is_err());
        }
    }
}
