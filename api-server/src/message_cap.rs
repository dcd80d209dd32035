//! One refusal for oversized messages on every service. Unary services (RideService, health)
//! refuse a message over their decoding cap with `OUT_OF_RANGE`; tonic-reflection's streaming
//! handler instead drops the call on any decode error and ends the stream with status OK. This
//! wrapper reads the gRPC length prefixes of a service's request stream: the first message
//! declared over the cap fails the request body (so the service never buffers it) and the call
//! ends with `OUT_OF_RANGE`, whatever the service answers.

use std::{
    convert::Infallible,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    task::{Context, Poll},
};

use bytes::{Buf, Bytes};
use http_body::{Body, Frame};
use tonic::{Status, body::Body as TonicBody, codegen::Service, server::NamedService};

/// A gRPC message's prefix: a compression flag and a 4-byte big-endian length.
const PREFIX_LEN: usize = 5;

/// The status every service ends an oversized call with.
pub fn too_large(max: usize) -> Status {
    Status::out_of_range(format!(
        "a request message is larger than this service's limit of {max} bytes"
    ))
}

#[derive(Clone)]
pub struct CapMessages<S> {
    inner: S,
    max: usize,
}

impl<S> CapMessages<S> {
    pub fn new(inner: S, max: usize) -> CapMessages<S> {
        CapMessages { inner, max }
    }
}

impl<S: NamedService> NamedService for CapMessages<S> {
    const NAME: &'static str = S::NAME;
}

impl<S> Service<http::Request<TonicBody>> for CapMessages<S>
where
    S: Service<http::Request<TonicBody>, Response = http::Response<TonicBody>, Error = Infallible>,
    S::Future: Send + 'static,
{
    type Response = http::Response<TonicBody>;
    type Error = Infallible;
    type Future =
        Pin<Box<dyn Future<Output = Result<http::Response<TonicBody>, Infallible>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Infallible>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<TonicBody>) -> Self::Future {
        let tripped = Arc::new(AtomicBool::new(false));
        let max = self.max;
        let request = request.map(|body| {
            TonicBody::new(Sniffed {
                inner: body,
                prefix: Prefix::default(),
                max,
                tripped: Arc::clone(&tripped),
            })
        });
        let answer = self.inner.call(request);
        Box::pin(async move {
            let response = answer.await?;
            Ok(response.map(|body| {
                TonicBody::new(Answered {
                    inner: body,
                    max,
                    tripped,
                    done: false,
                })
            }))
        })
    }
}

/// Where the reader is in the request stream's framing.
#[derive(Default)]
struct Prefix {
    header: [u8; PREFIX_LEN],
    have: usize,
    /// Bytes of the current message still to pass.
    skip: u64,
}

impl Prefix {
    /// Follows `bytes`. If a message declared over `max` starts in them: where its prefix starts
    /// (0 if it began in an earlier chunk), so the messages before it still reach the service.
    fn feed(&mut self, bytes: &[u8], max: usize) -> Option<usize> {
        let mut at = 0;
        while at < bytes.len() {
            if self.skip > 0 {
                let n = usize::try_from(self.skip)
                    .unwrap_or(usize::MAX)
                    .min(bytes.len() - at);
                self.skip -= n as u64;
                at += n;
                continue;
            }
            let starts_at = at.saturating_sub(self.have);
            let n = (PREFIX_LEN - self.have).min(bytes.len() - at);
            self.header[self.have..self.have + n].copy_from_slice(&bytes[at..at + n]);
            self.have += n;
            at += n;
            if self.have == PREFIX_LEN {
                let [_, a, b, c, d] = self.header;
                let len = u64::from(u32::from_be_bytes([a, b, c, d]));
                if len > max as u64 {
                    return Some(starts_at);
                }
                self.skip = len;
                self.have = 0;
            }
        }
        None
    }
}

/// The request body, failed at the first oversized message's prefix.
struct Sniffed {
    inner: TonicBody,
    prefix: Prefix,
    max: usize,
    tripped: Arc<AtomicBool>,
}

impl Body for Sniffed {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.tripped.load(Ordering::Acquire) {
            return Poll::Ready(Some(Err(too_large(this.max))));
        }
        let frame = match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame))) => frame,
            other => return other,
        };
        let oversized_at = frame
            .data_ref()
            .and_then(|data| this.prefix.feed(data.chunk(), this.max));
        let Some(at) = oversized_at else {
            return Poll::Ready(Some(Ok(frame)));
        };
        this.tripped.store(true, Ordering::Release);
        // The messages before the oversized one are still the caller's to have answered.
        match frame.into_data() {
            Ok(data) if at > 0 => Poll::Ready(Some(Ok(Frame::data(data.slice(..at))))),
            _ => Poll::Ready(Some(Err(too_large(this.max)))),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }
}

/// The response body, whose trailers say `OUT_OF_RANGE` once the request tripped the cap.
struct Answered {
    inner: TonicBody,
    max: usize,
    tripped: Arc<AtomicBool>,
    done: bool,
}

impl Answered {
    fn refusal_trailers(&self) -> Frame<Bytes> {
        let mut trailers = http::HeaderMap::new();
        // Only fails for a message that is not a valid header value; ours is ASCII.
        let _ = too_large(self.max).add_header(&mut trailers);
        Frame::trailers(trailers)
    }
}

impl Body for Answered {
    type Data = Bytes;
    type Error = Status;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Status>>> {
        let this = &mut *self;
        if this.done {
            return Poll::Ready(None);
        }
        match Pin::new(&mut this.inner).poll_frame(cx) {
            Poll::Ready(Some(Ok(frame)))
                if frame.is_trailers() && this.tripped.load(Ordering::Acquire) =>
            {
                this.done = true;
                Poll::Ready(Some(Ok(this.refusal_trailers())))
            }
            Poll::Ready(None) if this.tripped.load(Ordering::Acquire) => {
                this.done = true;
                Poll::Ready(Some(Ok(this.refusal_trailers())))
            }
            other => other,
        }
    }

    fn is_end_stream(&self) -> bool {
        self.done
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(len: u32) -> Vec<u8> {
        let mut framed = vec![0];
        framed.extend(len.to_be_bytes());
        framed.resize(PREFIX_LEN + len as usize, b'x');
        framed
    }

    #[test]
    fn finds_where_the_first_oversized_message_starts_across_any_split() {
        let stream = [message(10), message(3), message(100), message(1)].concat();
        let starts = message(10).len() + message(3).len();
        for split in 1..stream.len() {
            let mut prefix = Prefix::default();
            let found = match prefix.feed(&stream[..split], 50) {
                Some(at) => at,
                None => split + prefix.feed(&stream[split..], 50).unwrap(),
            };
            // Where its prefix starts; for a prefix split across the chunks, the second's start.
            let split_prefix = starts < split && split < starts + PREFIX_LEN;
            let expected = if split_prefix { split } else { starts };
            assert_eq!(found, expected, "split at {split}");
        }
        let mut prefix = Prefix::default();
        assert_eq!(prefix.feed(&[message(50), message(0)].concat(), 50), None);
    }
}
