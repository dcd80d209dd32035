//! A process's presence in PostgreSQL: what lets another process tell, at once, that the holder
//! of a key's lock is gone.
//!
//! A process that takes key locks opens one connection of its own (not from the pool) and holds a
//! session-level advisory lock on a random 64-bit holder id for as long as that connection lives;
//! every key lock it takes names the id (`idempotency_keys.lock_holder`). PostgreSQL releases a
//! session's advisory locks the moment the session ends, so a claim that asks
//! `idempotency_lock_state(…)` (the migration `lock_holders`) learns that a holder is gone as soon
//! as its process is killed (the kernel closes its socket), its connection is terminated, or the
//! server restarts or fails over. A holder cut off from PostgreSQL without a closed socket (a
//! partition) is found out by the server's TCP keepalives and user timeout, set on this session
//! only ([`SESSION_TCP`]): about five seconds.
//!
//! The other side is the holder's own fence: it confirms its session before it starts a provider
//! call ([`Liveness::confirm`]), and records nothing once it knows its session is gone
//! ([`Liveness::still_holds`]), since its keys may have been taken over. A heartbeat every
//! [`HEARTBEAT_EVERY`] is what it knows by; a session lost for good is replaced by a new one under
//! a new holder id (a new incarnation), never the old id, so a lock named by the old one stays
//! takeable.
//!
//! A paused process (SIGSTOP, a long pause) keeps its session: the kernel answers for its socket.
//! Its locks stay live until the lock timeout, as before holder ids, and on waking it starts no
//! provider call until a heartbeat has confirmed the session again.
//!
//! Behind a connection pooler in transaction mode a session lock does not follow the client: the
//! liveness connection must reach PostgreSQL directly or through a session-mode pool
//! (`DATABASE_LIVENESS_URL`, docs/configuration.md).

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use diesel::{QueryableByName, sql_types::BigInt, sql_types::Bool};
use diesel_async::{AsyncPgConnection, RunQueryDsl, SimpleAsyncConnection};
use tokio::sync::{Notify, watch};

/// A lock holder's id: the key of the advisory lock its session holds.
pub type HolderId = i64;

/// How often the holder checks its session.
pub const HEARTBEAT_EVERY: Duration = Duration::from_millis(500);
/// How long a heartbeat may take before the session is taken for lost. Longer than
/// [`CONFIRMED_FOR`], so a slow heartbeat first stops new provider calls and only later stops
/// records: a heartbeat caught in a pause of this process is not taken for a lost session.
pub const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(3);
/// How long a heartbeat's word counts: a holder starts a provider call only on a session
/// confirmed this recently, and otherwise waits this long for the next heartbeat.
pub const CONFIRMED_FOR: Duration = Duration::from_secs(2);
/// The first pause before opening a session again after a failure; it doubles up to
/// [`RECONNECT_MAX`].
const RECONNECT_FIRST: Duration = Duration::from_millis(100);
const RECONNECT_MAX: Duration = Duration::from_secs(2);
/// How soon after a failed try a lock may ask for the next one, cutting the back-off short: a
/// claim is about to use the database, which may well be back (a restart, a failover), and a
/// lock named by no holder costs its key the whole lock timeout if this process dies. At most
/// one try per this, however many locks ask (while the database is down, up to ten refused
/// connects a second instead of one every 2 s; still one warning per [`RECONNECT_MAX`]).
pub const ASKED_TRY_AFTER: Duration = Duration::from_millis(100);

/// The server's side of the liveness connection: a peer that stops answering (a partition, a
/// lost node) ends the session within about five seconds, releasing its holder id. Set on this
/// session only; ignored over a Unix socket.
pub const SESSION_TCP: &str = "SET tcp_keepalives_idle = 2; SET tcp_keepalives_interval = 1; \
     SET tcp_keepalives_count = 3; SET tcp_user_timeout = 5000";

#[derive(Clone, Copy, Debug)]
struct Presence {
    /// The holder id of the session, while it is believed alive.
    holder: Option<HolderId>,
    /// When a heartbeat last confirmed it.
    confirmed_at: Instant,
    /// A session is being opened (this process has just started, or is replacing a lost one):
    /// a lock taken now is worth waiting a moment for it. False while a failed attempt backs
    /// off.
    opening: bool,
    /// While backing off after a failure: from when a lock may ask for the next try at once.
    asks_from: Option<Instant>,
}

impl Presence {
    fn lost(opening: bool) -> Presence {
        Presence {
            holder: None,
            confirmed_at: Instant::now(),
            opening,
            asks_from: None,
        }
    }

    fn backing_off() -> Presence {
        Presence {
            asks_from: Some(Instant::now() + ASKED_TRY_AFTER),
            ..Presence::lost(false)
        }
    }

    /// The holder id, if a heartbeat confirmed it within [`CONFIRMED_FOR`].
    fn confirmed(&self) -> Option<HolderId> {
        self.holder
            .filter(|_| self.confirmed_at.elapsed() < CONFIRMED_FOR)
    }
}

/// This process's presence: the holder id to name in the locks it takes, and whether that
/// session still stands. Cheap to clone; the session lives while any clone does.
#[derive(Clone, Debug)]
pub struct Liveness {
    presence: watch::Receiver<Presence>,
    /// Wakes the session's keeper out of its back-off (`None`: no session is ever opened).
    ask: Option<Arc<Notify>>,
}

impl Liveness {
    /// Opens the liveness session to `url` in the background and keeps it: a session that fails
    /// is replaced, under a new holder id, until every clone of the returned handle is dropped.
    /// Until the first session stands, locks name no holder (they are then judged by the lock
    /// timeout alone).
    pub fn start(url: String) -> Liveness {
        let (sender, presence) = watch::channel(Presence::lost(true));
        let ask = Arc::new(Notify::new());
        tokio::spawn(keep_session(url, sender, Arc::clone(&ask)));
        Liveness {
            presence,
            ask: Some(ask),
        }
    }

    /// A presence that never stands: every lock names no holder. For tools and tests that take
    /// locks without a session of their own.
    pub fn absent() -> Liveness {
        let (_, presence) = watch::channel(Presence::lost(false));
        Liveness {
            presence,
            ask: None,
        }
    }

    /// The holder id to name in a lock taken now: the session's, if a heartbeat confirmed it
    /// within [`CONFIRMED_FOR`]. While a session is being opened (a process that has just
    /// started, or is replacing a lost session), waits up to that long for it, so that a server
    /// serving from its first moment names a holder in its first locks. While opening has failed
    /// and backs off, asks for a try at once (at most one per [`ASKED_TRY_AFTER`]) and waits for
    /// that try alone (a refused connect is quick; it never waits past [`CONFIRMED_FOR`]): after
    /// a database restart the pool is back before the session's back-off ends, and a lock taken
    /// meanwhile would name no holder. `None`: the lock is judged by the lock timeout alone.
    pub async fn holder_for_lock(&self) -> Option<HolderId> {
        let asked = self.ask_for_a_try();
        // Until the asked-for try has begun, a presence still backing off is the one asked about.
        let try_begun = AtomicBool::new(!asked);
        self.settled(|presence| match presence.confirmed() {
            Some(holder) => Some(Some(holder)),
            None if presence.opening => {
                try_begun.store(true, Ordering::Relaxed);
                None
            }
            None if !AtomicBool::load(&try_begun, Ordering::Relaxed) => None,
            None => Some(None),
        })
        .await
        .flatten()
    }

    /// Waits until a session stands, at most `bound`; whether one did. The api-server asks this
    /// once, before it first reports ready, so that callers routed by readiness reach it only
    /// once its locks name a holder. [`Liveness::absent`] never stands: false at once.
    pub async fn stands_within(&self, bound: Duration) -> bool {
        let mut presence = self.presence.clone();
        let standing = presence.wait_for(|presence| presence.holder.is_some());
        matches!(tokio::time::timeout(bound, standing).await, Ok(Ok(_)))
    }

    /// Wakes the keeper out of its back-off if it may try again now; whether it was asked.
    fn ask_for_a_try(&self) -> bool {
        let Some(ask) = &self.ask else { return false };
        let presence = *self.presence.borrow();
        let may_ask = presence
            .asks_from
            .is_some_and(|from| Instant::now() >= from);
        if may_ask {
            ask.notify_one();
        }
        may_ask
    }

    /// Whether the session named `holder` still stands as far as this process knows (its last
    /// heartbeat has not failed), however long ago it was confirmed. A lease whose session is
    /// gone records nothing: its key may have been taken over.
    pub fn still_holds(&self, holder: HolderId) -> bool {
        self.presence.borrow().holder == Some(holder)
    }

    /// Whether the session named `holder` stands, confirmed by a heartbeat within
    /// [`CONFIRMED_FOR`]; after a pause, waits up to that long for the next heartbeat. A holder
    /// starts a provider call only on `true`.
    pub async fn confirm(&self, holder: HolderId) -> bool {
        let confirmed = self
            .settled(|presence| match presence.holder {
                Some(current) if current != holder => Some(false),
                None => Some(false),
                Some(_) => presence.confirmed().map(|_| true),
            })
            .await;
        confirmed == Some(true)
    }

    /// The first answer `settle` gives on the presence as it is now or changes within
    /// [`CONFIRMED_FOR`]; `None` if it gave none by then.
    async fn settled<T>(&self, settle: impl Fn(&Presence) -> Option<T>) -> Option<T> {
        let mut presence = self.presence.clone();
        let deadline = tokio::time::Instant::now() + CONFIRMED_FOR;
        loop {
            if let Some(settled) = settle(&presence.borrow_and_update()) {
                return Some(settled);
            }
            match tokio::time::timeout_at(deadline, presence.changed()).await {
                Ok(Ok(())) => continue,
                Ok(Err(_)) | Err(_) => return None,
            }
        }
    }
}

/// Keeps a liveness session open and its presence published until nobody listens.
async fn keep_session(url: String, sender: watch::Sender<Presence>, ask: Arc<Notify>) {
    let mut pause = RECONNECT_FIRST;
    // Asked-for tries fail up to ten times a second while the database is down: one warning per
    // RECONNECT_MAX, the back-off's own pace, saying how many tries failed since the last one.
    let (mut warned_at, mut failed_tries) = (None::<Instant>, 0u32);
    while !sender.is_closed() {
        sender.send_replace(Presence::lost(true));
        match open_session(&url).await {
            Ok((conn, holder)) => {
                pause = RECONNECT_FIRST;
                tracing::info!(holder, "liveness session open");
                heartbeat(conn, holder, &sender).await;
                tracing::warn!(holder, "liveness session lost; opening another");
            }
            Err(error) => {
                failed_tries += 1;
                if warned_at.is_none_or(|at| at.elapsed() >= RECONNECT_MAX) {
                    tracing::warn!(error = %telemetry::error_chain(&error), failed_tries, "cannot open the liveness session");
                    (warned_at, failed_tries) = (Some(Instant::now()), 0);
                }
            }
        }
        sender.send_replace(Presence::backing_off());
        back_off(pause, &ask).await;
        pause = (pause * 2).min(RECONNECT_MAX);
    }
}

/// Waits `pause` before the next try, or less if a lock asks for one after [`ASKED_TRY_AFTER`].
async fn back_off(pause: Duration, ask: &Notify) {
    tokio::time::sleep(pause.min(ASKED_TRY_AFTER)).await;
    if pause > ASKED_TRY_AFTER {
        tokio::select! {
            () = tokio::time::sleep(pause - ASKED_TRY_AFTER) => {}
            () = ask.notified() => {}
        }
    }
}

/// Confirms the session every [`HEARTBEAT_EVERY`] until a heartbeat fails or nobody listens.
async fn heartbeat(
    mut conn: AsyncPgConnection,
    holder: HolderId,
    sender: &watch::Sender<Presence>,
) {
    loop {
        sender.send_replace(Presence {
            holder: Some(holder),
            confirmed_at: Instant::now(),
            opening: false,
            asks_from: None,
        });
        tokio::time::sleep(HEARTBEAT_EVERY).await;
        if sender.is_closed() {
            return;
        }
        match tokio::time::timeout(HEARTBEAT_TIMEOUT, conn.batch_execute("SELECT 1")).await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                tracing::warn!(holder, error = %error, "liveness heartbeat failed");
                return;
            }
            Err(_) => {
                tracing::warn!(holder, "liveness heartbeat timed out");
                return;
            }
        }
    }
}

/// Why a liveness session could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum SessionError {
    #[error("cannot connect")]
    Connect(#[source] diesel::ConnectionError),
    #[error("cannot take a holder id")]
    Query(#[source] diesel::result::Error),
}

/// A new session holding the advisory lock of a fresh random holder id.
async fn open_session(url: &str) -> Result<(AsyncPgConnection, HolderId), SessionError> {
    #[derive(QueryableByName)]
    struct Taken {
        #[diesel(sql_type = Bool)]
        taken: bool,
    }
    let mut conn = crate::connect(url).await.map_err(SessionError::Connect)?;
    conn.batch_execute(SESSION_TCP)
        .await
        .map_err(SessionError::Query)?;
    loop {
        // Random, so that no later incarnation of any process names a dead one's locks; taken
        // with a try, so that the one-in-2^64 id already held is drawn again, not waited for.
        let holder = rand::random::<HolderId>();
        let taken: Taken = diesel::sql_query("SELECT pg_try_advisory_lock($1) AS taken")
            .bind::<BigInt, _>(holder)
            .get_result(&mut conn)
            .await
            .map_err(SessionError::Query)?;
        if taken.taken {
            return Ok((conn, holder));
        }
    }
}
