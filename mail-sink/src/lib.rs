//! A small SMTP server for development and tests. It speaks what lettre needs (EHLO/HELO, MAIL
//! FROM, RCPT TO, DATA with dot-unstuffing, RSET, NOOP, QUIT), keeps what it receives in memory,
//! optionally writes each mail to `DIR/<n>.eml`, and can be told to answer the next N messages
//! with a failure code (e.g. 451) to exercise retries. It accepts every address and never relays.
//!
//! Like a real relay it can be asked, after the fact, whether it accepted a message: an HTTP
//! endpoint with the shape of Mailpit's `GET /api/v1/search?query=message-id:<id>` (what the
//! receipt worker's `workers::relay_search` asks). With a directory, mails stored by an earlier
//! run are loaded at start, so a restarted sink still answers for them.
//!
//! What it keeps in memory is bounded ([`Retention`]): beyond a count or a total size of mails,
//! the oldest are dropped from memory (their `.eml` files stay), so a long run or a flood cannot
//! grow it without bound. A dropped mail is no longer found by the search, so the defaults are
//! sized for the benchmark's ~100,000 receipts of a few KB, and a search follows its send closely.
//!
//! A development tool, not part of the worker fleet: the `mail-sink` binary (`src/main.rs`) runs
//! it for local runs, the benchmark, the crash-and-fault campaign and staging, and the workers'
//! tests spawn it in-process. Like fake-stripe for Stripe, it stands in for the real service and
//! shares no code with its client.

use std::{
    collections::VecDeque,
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use bytes::Bytes;
use http_body_util::Full;
use hyper::{StatusCode, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use tokio::{
    io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader},
    net::{TcpListener, TcpStream},
    sync::Notify,
};
use tokio_util::sync::CancellationToken;

/// Longest accepted command line and mail; both are generous for receipts.
const MAX_LINE: usize = 4096;
const MAX_MESSAGE: usize = 10 * 1024 * 1024;

/// One accepted mail.
#[derive(Clone, Debug)]
pub struct ReceivedMail {
    pub mail_from: String,
    pub rcpt_to: Vec<String>,
    /// The message as received, after dot-unstuffing, lines joined with CRLF.
    pub data: String,
}

impl ReceivedMail {
    /// The first header with this name (case-insensitive), unfolded.
    pub fn header(&self, name: &str) -> Option<String> {
        let head = self.data.split("\r\n\r\n").next().unwrap_or_default();
        let mut found: Option<String> = None;
        for line in head.split("\r\n") {
            if line.starts_with([' ', '\t']) {
                if let Some(value) = found.as_mut() {
                    value.push(' ');
                    value.push_str(line.trim());
                }
                continue;
            }
            if found.is_some() {
                break;
            }
            if let Some((key, value)) = line.split_once(':')
                && key.eq_ignore_ascii_case(name)
            {
                found = Some(value.trim().to_owned());
            }
        }
        found
    }

    pub fn message_id(&self) -> Option<String> {
        self.header("Message-ID")
    }
}

/// The mails kept in memory, oldest first, and the sum of their `data` lengths.
#[derive(Default)]
struct Kept {
    mails: VecDeque<ReceivedMail>,
    bytes: usize,
}

impl std::ops::Deref for Kept {
    type Target = VecDeque<ReceivedMail>;

    fn deref(&self) -> &VecDeque<ReceivedMail> {
        &self.mails
    }
}

/// How much the sink keeps in memory; the oldest mails are dropped first.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Retention {
    pub max_mails: usize,
    /// The sum of the kept mails' `data` lengths.
    pub max_bytes: usize,
}

impl Default for Retention {
    fn default() -> Retention {
        Retention {
            max_mails: 100_000,
            max_bytes: 256 * 1024 * 1024,
        }
    }
}

#[derive(Default)]
struct State {
    retention: Retention,
    mails: Mutex<Kept>,
    /// Reply codes for the next messages' end of DATA, front first.
    failures: Mutex<VecDeque<u16>>,
    /// How many of the next searches answer 503.
    search_failures: Mutex<usize>,
    /// How long the next messages' end of DATA takes before they are kept, front first.
    slow_accepts: Mutex<VecDeque<Duration>>,
    received: Notify,
}

impl State {
    fn mails(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.mails.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `mail`, dropping the oldest mails beyond the retention limits.
    fn keep(&self, mail: ReceivedMail) {
        let mut kept = self.mails();
        kept.bytes += mail.data.len();
        kept.mails.push_back(mail);
        while kept.mails.len() > self.retention.max_mails || kept.bytes > self.retention.max_bytes {
            let Some(oldest) = kept.mails.pop_front() else {
                break;
            };
            kept.bytes -= oldest.data.len();
        }
    }

    fn next_slow_accept(&self) -> Option<Duration> {
        self.slow_accepts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }

    fn next_failure(&self) -> Option<u16> {
        self.failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front()
    }
}

/// A running sink. Dropping it stops accepting connections.
pub struct MailSink {
    addr: SocketAddr,
    state: Arc<State>,
    stop: CancellationToken,
}

impl MailSink {
    /// Binds `listen` (port 0 picks a free port) and serves in a background task, keeping
    /// [`Retention::default`] in memory.
    pub async fn spawn(listen: SocketAddr, dir: Option<PathBuf>) -> std::io::Result<MailSink> {
        MailSink::spawn_with(listen, dir, Retention::default()).await
    }

    /// [`MailSink::spawn`], keeping at most `retention` in memory.
    pub async fn spawn_with(
        listen: SocketAddr,
        dir: Option<PathBuf>,
        retention: Retention,
    ) -> std::io::Result<MailSink> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        if let Some(dir) = &dir {
            tokio::fs::create_dir_all(dir).await?;
        }
        let state = Arc::new(State {
            retention,
            ..State::default()
        });
        if let Some(dir) = &dir {
            for mail in load(dir).await? {
                state.keep(mail);
            }
        }
        let stop = CancellationToken::new();
        tokio::spawn(serve(listener, Arc::clone(&state), dir, stop.clone()));
        Ok(MailSink { addr, state, stop })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to put in `SMTP_URL`.
    pub fn smtp_url(&self) -> String {
        format!("smtp://{}", self.addr)
    }

    /// Everything received so far, in order.
    pub fn received(&self) -> Vec<ReceivedMail> {
        self.state.mails().iter().cloned().collect()
    }

    /// Answers the end of DATA of the next `count` messages with `code` (a 4xx is a temporary
    /// failure, a 5xx a permanent one) and discards them.
    pub fn fail_next(&self, count: usize, code: u16) {
        let mut failures = self
            .state
            .failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        failures.extend(std::iter::repeat_n(code, count));
    }

    /// Takes `delay` over the end of DATA of the next `count` messages before keeping and
    /// accepting them, as a loaded relay does: a client that gives up in that time has still
    /// handed the relay a mail it keeps.
    pub fn accept_slowly_next(&self, count: usize, delay: Duration) {
        self.state
            .slow_accepts
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .extend(std::iter::repeat_n(delay, count));
    }

    /// Answers the next `count` searches with 503, as a relay whose API is down.
    pub fn fail_next_searches(&self, count: usize) {
        *self
            .state
            .search_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner) += count;
    }

    /// Serves the message search on `listen` (port 0 picks one) until the sink stops; returns
    /// the base URL to put in `MAIL_SEARCH_URL`.
    pub async fn serve_search(&self, listen: SocketAddr) -> std::io::Result<String> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        tokio::spawn(serve_http(
            listener,
            Arc::clone(&self.state),
            self.stop.clone(),
        ));
        Ok(format!("http://{addr}"))
    }

    /// Waits until at least `count` mails arrived or `timeout` passed; returns what arrived.
    pub async fn wait_for(&self, count: usize, timeout: Duration) -> Vec<ReceivedMail> {
        let deadline = tokio::time::Instant::now() + timeout;
        loop {
            let notified = self.state.received.notified();
            let mails = self.received();
            if mails.len() >= count {
                return mails;
            }
            if tokio::time::timeout_at(deadline, notified).await.is_err() {
                return self.received();
            }
        }
    }

    /// Stops accepting connections.
    pub fn stop(&self) {
        self.stop.cancel();
    }

    /// Serves until `shutdown` is cancelled (the `mail-sink` binary).
    pub async fn run_until(self, shutdown: CancellationToken) {
        shutdown.cancelled().await;
        self.stop();
    }
}

impl Drop for MailSink {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    dir: Option<PathBuf>,
    stop: CancellationToken,
) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        match accepted {
            Ok((stream, peer)) => {
                let state = Arc::clone(&state);
                let dir = dir.clone();
                let stop = stop.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        () = stop.cancelled() => {}
                        result = session(stream, &state, dir.as_deref()) => {
                            if let Err(error) = result {
                                tracing::debug!(%error, %peer, "mail sink session ended");
                            }
                        }
                    }
                });
            }
            Err(error) => {
                tracing::warn!(%error, "mail sink cannot accept");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    }
}

async fn serve_http(listener: TcpListener, state: Arc<State>, stop: CancellationToken) {
    loop {
        let accepted = tokio::select! {
            () = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        let Ok((stream, _)) = accepted else {
            tokio::time::sleep(Duration::from_millis(50)).await;
            continue;
        };
        let state = Arc::clone(&state);
        tokio::spawn(async move {
            let service = service_fn(move |request: hyper::Request<Incoming>| {
                let answer = search(&state, request.uri());
                async move { Ok::<_, Infallible>(answer) }
            });
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

/// `GET /api/v1/search?query=message-id:<id>`, answered in Mailpit's shape. Only Message-ID
/// searches are supported; anything else is a 400 rather than a silently empty answer.
fn search(state: &State, uri: &hyper::Uri) -> hyper::Response<Full<Bytes>> {
    let reply = |status: StatusCode, body: serde_json::Value| {
        let mut response = hyper::Response::new(Full::new(Bytes::from(body.to_string())));
        *response.status_mut() = status;
        response.headers_mut().insert(
            hyper::header::CONTENT_TYPE,
            hyper::header::HeaderValue::from_static("application/json"),
        );
        response
    };
    if uri.path() != "/api/v1/search" {
        return reply(
            StatusCode::NOT_FOUND,
            serde_json::json!({"Error": "not found"}),
        );
    }
    {
        let mut failures = state
            .search_failures
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if *failures > 0 {
            *failures -= 1;
            return reply(
                StatusCode::SERVICE_UNAVAILABLE,
                serde_json::json!({"Error": "injected failure"}),
            );
        }
    }
    let query = uri
        .query()
        .and_then(|q| serde_urlencoded::from_str::<Vec<(String, String)>>(q).ok())
        .and_then(|pairs| pairs.into_iter().find(|(k, _)| k == "query"))
        .map(|(_, v)| v)
        .unwrap_or_default();
    let Some(wanted) = query.trim().strip_prefix("message-id:") else {
        return reply(
            StatusCode::BAD_REQUEST,
            serde_json::json!({"Error": "only message-id:<id> searches are supported"}),
        );
    };
    let wanted = bare(wanted.trim_matches('"'));
    let mails = state.mails();
    let messages: Vec<serde_json::Value> = mails
        .iter()
        .enumerate()
        .filter_map(|(n, mail)| {
            let id = mail.message_id()?;
            (bare(&id) == wanted).then(|| {
                serde_json::json!({
                    "ID": n.to_string(),
                    "MessageID": bare(&id),
                    "Subject": mail.header("Subject").unwrap_or_default(),
                })
            })
        })
        .collect();
    reply(
        StatusCode::OK,
        serde_json::json!({
            "total": mails.len(),
            "unread": mails.len(),
            "count": messages.len(),
            "messages_count": messages.len(),
            "start": 0,
            "tags": [],
            "messages": messages,
        }),
    )
}

/// `<id@host>` → `id@host`, as a relay compares Message-IDs. Deliberately the sink's own and not
/// the receipt worker's (`workers::relay_search::bare`): the sink stands in for a real relay, as
/// fake-stripe does for Stripe, so it must not borrow its client's reading of the protocol (and
/// it does not depend on the fleet).
fn bare(message_id: &str) -> &str {
    let trimmed = message_id.trim();
    trimmed
        .strip_prefix('<')
        .and_then(|rest| rest.strip_suffix('>'))
        .unwrap_or(trimmed)
}

/// The mails a previous run stored in `dir`.
async fn load(dir: &Path) -> std::io::Result<Vec<ReceivedMail>> {
    let mut names = Vec::new();
    let mut entries = tokio::fs::read_dir(dir).await?;
    while let Some(entry) = entries.next_entry().await? {
        let name = entry.file_name().to_string_lossy().into_owned();
        if name.ends_with(".eml") && !name.starts_with('.') {
            names.push(name);
        }
    }
    names.sort();
    let mut mails = Vec::with_capacity(names.len());
    for name in names {
        let data = tokio::fs::read_to_string(dir.join(&name)).await?;
        mails.push(ReceivedMail {
            mail_from: String::new(),
            rcpt_to: Vec::new(),
            data: data.strip_suffix("\r\n").unwrap_or(&data).to_owned(),
        });
    }
    Ok(mails)
}

/// One SMTP conversation.
async fn session(stream: TcpStream, state: &State, dir: Option<&Path>) -> std::io::Result<()> {
    let (read, mut write) = stream.into_split();
    let mut reader = BufReader::new(read);
    write.write_all(b"220 mail-sink ESMTP ready\r\n").await?;
    let mut mail_from: Option<String> = None;
    let mut rcpt_to: Vec<String> = Vec::new();
    let mut line = String::new();
    loop {
        line.clear();
        let read = (&mut reader)
            .take(MAX_LINE as u64)
            .read_line(&mut line)
            .await?;
        if read == 0 {
            return Ok(());
        }
        let command = line.trim_end_matches(['\r', '\n']);
        let verb = command
            .split_whitespace()
            .next()
            .unwrap_or_default()
            .to_ascii_uppercase();
        let reply: &[u8] = match verb.as_str() {
            "EHLO" | "HELO" => {
                mail_from = None;
                rcpt_to.clear();
                b"250 mail-sink\r\n"
            }
            "MAIL" => match address_after(command, "FROM:") {
                Some(address) => {
                    mail_from = Some(address);
                    rcpt_to.clear();
                    b"250 2.1.0 OK\r\n"
                }
                None => b"501 5.5.4 syntax: MAIL FROM:<address>\r\n",
            },
            "RCPT" => match (&mail_from, address_after(command, "TO:")) {
                (None, _) => b"503 5.5.1 MAIL first\r\n",
                (Some(_), Some(address)) => {
                    rcpt_to.push(address);
                    b"250 2.1.5 OK\r\n"
                }
                (Some(_), None) => b"501 5.5.4 syntax: RCPT TO:<address>\r\n",
            },
            "DATA" => {
                let Some(from) = mail_from.take().filter(|_| !rcpt_to.is_empty()) else {
                    write
                        .write_all(b"503 5.5.1 MAIL and RCPT first\r\n")
                        .await?;
                    continue;
                };
                write.write_all(b"354 end with <CRLF>.<CRLF>\r\n").await?;
                let data = read_data(&mut reader).await?;
                let rcpts = std::mem::take(&mut rcpt_to);
                match data {
                    None => b"552 5.3.4 message too big\r\n",
                    Some(data) => {
                        if let Some(code) = state.next_failure() {
                            let reply = format!("{code} injected failure, try again\r\n");
                            write.write_all(reply.as_bytes()).await?;
                            continue;
                        }
                        if let Some(delay) = state.next_slow_accept() {
                            tokio::time::sleep(delay).await;
                        }
                        let mail = ReceivedMail {
                            mail_from: from,
                            rcpt_to: rcpts,
                            data,
                        };
                        if let Some(dir) = dir {
                            store(dir, &mail).await?;
                        }
                        state.keep(mail);
                        state.received.notify_waiters();
                        b"250 2.0.0 queued\r\n"
                    }
                }
            }
            "RSET" => {
                mail_from = None;
                rcpt_to.clear();
                b"250 2.0.0 OK\r\n"
            }
            "NOOP" => b"250 2.0.0 OK\r\n",
            "VRFY" => b"252 2.5.2 cannot verify\r\n",
            "QUIT" => {
                write.write_all(b"221 2.0.0 bye\r\n").await?;
                return Ok(());
            }
            _ => b"502 5.5.2 command not implemented\r\n",
        };
        write.write_all(reply).await?;
    }
}

/// Reads DATA up to the lone dot, undoing dot-stuffing. `None` if the message is too big (the
/// rest is still consumed so the conversation stays in step).
async fn read_data<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
) -> std::io::Result<Option<String>> {
    let mut data = String::new();
    let mut too_big = false;
    let mut raw = Vec::new();
    loop {
        raw.clear();
        let read = reader.read_until(b'\n', &mut raw).await?;
        if read == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        let line = String::from_utf8_lossy(&raw);
        let line = line.trim_end_matches(['\r', '\n']);
        if line == "." {
            return Ok((!too_big).then_some(data));
        }
        let line = line.strip_prefix('.').unwrap_or(line);
        if data.len() + line.len() > MAX_MESSAGE {
            too_big = true;
            continue;
        }
        if !data.is_empty() {
            data.push_str("\r\n");
        }
        data.push_str(line);
    }
}

/// `MAIL FROM:<a@b> BODY=8BITMIME` → `a@b`.
fn address_after(command: &str, keyword: &str) -> Option<String> {
    let upper = command.to_ascii_uppercase();
    let start = upper.find(keyword)? + keyword.len();
    let rest = command[start..].trim_start();
    let rest = rest.strip_prefix('<')?;
    let end = rest.find('>')?;
    Some(rest[..end].to_owned())
}

/// Writes `<nanos>-<n>.eml` via a temporary name, so readers never see half a mail.
async fn store(dir: &Path, mail: &ReceivedMail) -> std::io::Result<()> {
    static SEQUENCE: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = SEQUENCE.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let stamp = chrono::Utc::now().timestamp_nanos_opt().unwrap_or_default();
    let name = format!("{stamp}-{n}.eml");
    let temporary = dir.join(format!(".{name}.tmp"));
    tokio::fs::write(&temporary, format!("{}\r\n", mail.data)).await?;
    tokio::fs::rename(&temporary, dir.join(name)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_addresses() {
        assert_eq!(
            address_after("MAIL FROM:<a@b.c> BODY=8BITMIME", "FROM:").as_deref(),
            Some("a@b.c")
        );
        assert_eq!(
            address_after("rcpt to: <x@y>", "TO:").as_deref(),
            Some("x@y")
        );
        assert_eq!(address_after("MAIL FROM:a@b", "FROM:"), None);
    }

    #[tokio::test]
    async fn unstuffs_dots() {
        let input = b"Subject: x\r\n\r\n..leading dot\r\nplain\r\n.\r\n".to_vec();
        let mut reader = BufReader::new(&input[..]);
        let data = read_data(&mut reader).await.unwrap().unwrap();
        assert_eq!(data, "Subject: x\r\n\r\n.leading dot\r\nplain");
    }

    fn mail(data: &str) -> ReceivedMail {
        ReceivedMail {
            mail_from: String::new(),
            rcpt_to: vec![],
            data: data.into(),
        }
    }

    fn kept(state: &State) -> Vec<String> {
        state.mails().iter().map(|mail| mail.data.clone()).collect()
    }

    #[test]
    fn keeps_at_most_its_retention_dropping_the_oldest() {
        let state = State {
            retention: Retention {
                max_mails: 2,
                max_bytes: 10,
            },
            ..State::default()
        };
        state.keep(mail("aaa"));
        state.keep(mail("bbb"));
        state.keep(mail("ccc"));
        assert_eq!(kept(&state), ["bbb", "ccc"], "by count");
        state.keep(mail("dddddddd"));
        assert_eq!(kept(&state), ["dddddddd"], "by bytes");
        // A mail larger than the byte limit is not kept at all.
        state.keep(mail("eeeeeeeeeee"));
        assert!(kept(&state).is_empty());
    }

    #[test]
    fn reads_headers() {
        let mail = ReceivedMail {
            mail_from: String::new(),
            rcpt_to: vec![],
            data: "Message-ID: <a@b>\r\nSubject: long\r\n  folded\r\n\r\nMessage-ID: body".into(),
        };
        assert_eq!(mail.message_id().as_deref(), Some("<a@b>"));
        assert_eq!(mail.header("subject").as_deref(), Some("long folded"));
    }

    #[test]
    fn searches_message_ids_without_their_angle_brackets() {
        assert_eq!(bare(" <a@b> "), "a@b");
        assert_eq!(bare("a@b>"), "a@b>");
    }
}
