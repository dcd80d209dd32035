//! A small SMTP server for development and tests. It speaks what lettre needs (EHLO/HELO, MAIL
//! FROM, RCPT TO, DATA with dot-unstuffing, RSET, NOOP, QUIT; with a certificate, STARTTLS, a
//! TLS-from-the-first-byte `smtps` listener and AUTH PLAIN over TLS only), keeps what it receives in memory,
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
    collections::{HashMap, VecDeque},
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, PoisonError},
    time::Duration,
};

use tokio::{net::TcpListener, sync::Notify};
use tokio_util::sync::CancellationToken;

mod search;
mod smtp;
mod tls;

pub use self::tls::SinkTls;
use self::{
    search::serve_http,
    smtp::{session, smtps_session},
};

/// One accepted mail.
#[derive(Clone, Debug)]
pub struct ReceivedMail {
    pub mail_from: String,
    pub rcpt_to: Vec<String>,
    /// The message as received, after dot-unstuffing, lines joined with CRLF.
    pub data: String,
    /// Whether TLS carried it (STARTTLS or `smtps`); false for mails loaded from a directory.
    pub over_tls: bool,
}

/// Credentials a client sent (AUTH PLAIN): the user, and whether TLS carried them. Over plain
/// SMTP they are refused, but a client that sent them inline has already leaked them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Login {
    pub user: String,
    pub over_tls: bool,
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

/// The mails kept in memory, oldest first, the sum of their `data` lengths, and an index of
/// them by Message-ID: a relay's search is a lookup, not a scan (a long campaign keeps some 70,000
/// mails, and scanning them all per search under the lock stalled the sink).
#[derive(Default)]
struct Kept {
    mails: VecDeque<ReceivedMail>,
    bytes: usize,
    /// The sequence number of the front mail; each mail's is that plus its position.
    front: u64,
    /// Bare Message-ID → the sequence numbers of the kept mails carrying it, oldest first.
    by_message_id: HashMap<String, VecDeque<u64>>,
}

impl Kept {
    fn push(&mut self, mail: ReceivedMail) {
        let seq = self.front + self.mails.len() as u64;
        if let Some(id) = mail.message_id() {
            self.by_message_id
                .entry(search::bare(&id).to_owned())
                .or_default()
                .push_back(seq);
        }
        self.bytes += mail.data.len();
        self.mails.push_back(mail);
    }

    fn pop_oldest(&mut self) -> Option<ReceivedMail> {
        let oldest = self.mails.pop_front()?;
        self.bytes -= oldest.data.len();
        if let Some(id) = oldest.message_id() {
            let id = search::bare(&id).to_owned();
            if let Some(seqs) = self.by_message_id.get_mut(&id) {
                seqs.pop_front();
                if seqs.is_empty() {
                    self.by_message_id.remove(&id);
                }
            }
        }
        self.front += 1;
        Some(oldest)
    }

    /// The kept mails whose bare Message-ID is `id`, with their sequence numbers.
    fn with_message_id(&self, id: &str) -> Vec<(u64, &ReceivedMail)> {
        self.by_message_id
            .get(id)
            .into_iter()
            .flatten()
            .filter_map(|seq| {
                let position = usize::try_from(seq.checked_sub(self.front)?).ok()?;
                Some((*seq, self.mails.get(position)?))
            })
            .collect()
    }
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
    /// STARTTLS and `smtps`, when the sink has a certificate.
    tls: Option<SinkTls>,
    logins: Mutex<Vec<Login>>,
}

impl State {
    fn mails(&self) -> std::sync::MutexGuard<'_, Kept> {
        self.mails.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps `mail`, dropping the oldest mails beyond the retention limits.
    fn keep(&self, mail: ReceivedMail) {
        let mut kept = self.mails();
        kept.push(mail);
        while kept.mails.len() > self.retention.max_mails || kept.bytes > self.retention.max_bytes {
            if kept.pop_oldest().is_none() {
                break;
            }
        }
    }

    fn login(&self, login: Login) {
        self.logins
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(login);
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
    listening: Listening,
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
        MailSink::spawn_with_tls(listen, dir, retention, None).await
    }

    /// [`MailSink::spawn_with`], offering STARTTLS with `tls` (and [`MailSink::serve_smtps`]).
    pub async fn spawn_with_tls(
        listen: SocketAddr,
        dir: Option<PathBuf>,
        retention: Retention,
        tls: Option<SinkTls>,
    ) -> std::io::Result<MailSink> {
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        if let Some(dir) = &dir {
            tokio::fs::create_dir_all(dir).await?;
        }
        let state = Arc::new(State {
            retention,
            tls,
            ..State::default()
        });
        if let Some(dir) = &dir {
            for mail in load(dir).await? {
                state.keep(mail);
            }
        }
        let stop = CancellationToken::new();
        let listening = Listening {
            state: Arc::clone(&state),
            dir: dir.clone(),
            stop: stop.clone(),
        };
        tokio::spawn(listening.clone().serve(listener, None));
        Ok(MailSink {
            addr,
            state,
            stop,
            listening,
        })
    }

    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The URL to put in `SMTP_URL`.
    pub fn smtp_url(&self) -> String {
        format!("smtp://{}", self.addr)
    }

    /// Serves SMTP over TLS from the first byte on `listen` (port 0 picks one) until the sink
    /// stops; returns the URL to put in `SMTP_URL` (without the `cacertfile` a client needs).
    /// Only a sink spawned with TLS can.
    pub async fn serve_smtps(&self, listen: SocketAddr) -> std::io::Result<String> {
        let Some(tls) = self.state.tls.clone() else {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the mail sink has no certificate for smtps",
            ));
        };
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        tokio::spawn(self.listening.clone().serve(listener, Some(tls)));
        Ok(format!("smtps://{addr}"))
    }

    /// Every AUTH seen so far, in order.
    pub fn logins(&self) -> Vec<Login> {
        self.state
            .logins
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
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

/// What every listener's sessions share.
#[derive(Clone)]
struct Listening {
    state: Arc<State>,
    dir: Option<PathBuf>,
    stop: CancellationToken,
}

impl Listening {
    /// Accepts until the sink stops; with `implicit_tls`, every session is TLS from the start.
    async fn serve(self, listener: TcpListener, implicit_tls: Option<SinkTls>) {
        loop {
            let accepted = tokio::select! {
                () = self.stop.cancelled() => return,
                accepted = listener.accept() => accepted,
            };
            match accepted {
                Ok((stream, peer)) => {
                    let listening = self.clone();
                    let implicit_tls = implicit_tls.clone();
                    tokio::spawn(async move {
                        let (state, dir) = (&listening.state, listening.dir.as_deref());
                        let conversation = async {
                            match &implicit_tls {
                                None => session(stream, state, dir).await,
                                Some(tls) => smtps_session(stream, tls, state, dir).await,
                            }
                        };
                        tokio::select! {
                            () = listening.stop.cancelled() => {}
                            result = conversation => {
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
            over_tls: false,
        });
    }
    Ok(mails)
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
mod tests;
