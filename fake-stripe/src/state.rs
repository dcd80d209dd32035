//! In-memory state of one fake Stripe account: the PaymentIntent ledger, the idempotency
//! store and the queue of injected faults.
//!
//! Everything lives behind one `std::sync::Mutex`. The lock is only ever taken for short,
//! synchronous sections and never across an `.await`, so a plain mutex is both simpler and
//! faster than an async one. Recording a PaymentIntent and storing the response under its
//! idempotency key happen in the same critical section, so an observer never sees one
//! without the other (this is what makes `charge_then_drop` retries deterministic).

use std::collections::{BTreeMap, HashMap, VecDeque};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Instant;

use bytes::Bytes;
use http::StatusCode;
use rand::Rng;
use rand::distr::Alphanumeric;
use serde::{Deserialize, Serialize};

use crate::Config;

/// A PaymentIntent as Stripe serialises it (the subset of fields we model).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct PaymentIntent {
    pub id: String,
    pub object: String,
    pub amount: i64,
    pub amount_received: i64,
    pub currency: String,
    pub customer: Option<String>,
    pub payment_method: Option<String>,
    pub description: Option<String>,
    pub metadata: BTreeMap<String, String>,
    pub status: String,
    pub created: i64,
    pub latest_charge: Option<String>,
    pub livemode: bool,
    pub confirmation_method: String,
}

/// A fault to inject into the next `POST /v1/payment_intents` call.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum FaultMode {
    /// Answer 500 `api_error` before executing anything (nothing is charged or stored).
    #[serde(rename = "error_500")]
    Error500,
    /// Never answer; hold the connection open until the server shuts down. Nothing is charged.
    Timeout,
    /// Charge and store the result under the idempotency key, then close the connection
    /// without writing a response: the classic "did my charge go through?" case.
    ChargeThenDrop,
    /// Execute the charge, but only after `Config::slow_fault_delay` (default 8 s): longer than
    /// any client's timeout and than the api-server's key lock. The idempotency key stays in
    /// flight meanwhile, so a retry with it gets 409 `idempotency_key_in_use`, and once the charge
    /// is done, its stored result.
    Slow,
}

/// A response frozen for idempotent replay: Stripe replays status and body verbatim.
#[derive(Clone, Debug)]
pub(crate) struct StoredResponse {
    pub status: StatusCode,
    pub body: Bytes,
}

/// Idempotency keys are scoped per API key, as at Stripe: `(api key, idempotency key)`.
type Scope = (String, String);

enum KeyState {
    InFlight,
    Done(StoredResponse),
}

struct KeyEntry {
    /// Sorted form parameters of the first request, compared order-insensitively.
    params: Vec<(String, String)>,
    /// The window is measured from the key's first use, not from its last replay.
    first_used: Instant,
    state: KeyState,
}

/// Outcome of presenting an idempotency key.
pub(crate) enum Begin {
    /// First use (or first use after expiry): go ahead and execute.
    Execute(Reservation),
    Replay(StoredResponse),
    Mismatch,
    InUse,
}

#[derive(Default)]
struct Inner {
    intents: Vec<PaymentIntent>,
    by_id: HashMap<String, usize>,
    keys: HashMap<Scope, KeyEntry>,
    /// Keys in first-use order, so expired ones can be pruned from the front cheaply.
    key_order: VecDeque<(Instant, Scope)>,
    /// Pending faults as run-length `(mode, remaining)` so a huge count costs no memory.
    faults: VecDeque<(FaultMode, usize)>,
}

/// Shared server state; cloned into every connection as an `Arc`.
pub(crate) struct State {
    pub config: Config,
    create_calls: AtomicUsize,
    inner: Mutex<Inner>,
}

/// Holds an idempotency key in the "in flight" state. If the request is abandoned before
/// it completes (e.g. the task is cancelled), dropping the reservation frees the key, as
/// Stripe does for requests that fail before they finish executing.
pub(crate) struct Reservation {
    state: Arc<State>,
    scope: Option<Scope>,
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if let Some(scope) = self.scope.take() {
            let mut inner = self.state.lock();
            if matches!(inner.keys.get(&scope), Some(e) if matches!(e.state, KeyState::InFlight)) {
                inner.keys.remove(&scope);
            }
        }
    }
}

/// `prefix` followed by `len` random alphanumerics, the shape of Stripe's object ids.
pub(crate) fn random_id(prefix: &str, len: usize) -> String {
    let tail: String = rand::rng()
        .sample_iter(Alphanumeric)
        .take(len)
        .map(char::from)
        .collect();
    format!("{prefix}{tail}")
}

impl State {
    pub fn new(config: Config) -> Arc<Self> {
        Arc::new(State {
            config,
            create_calls: AtomicUsize::new(0),
            inner: Mutex::default(),
        })
    }

    /// Poisoning only follows a panic, and nothing under this lock can leave the data
    /// half-updated, so recovering the guard is safe and keeps the server answering.
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    pub fn count_create_call(&self) {
        self.create_calls.fetch_add(1, Ordering::Relaxed);
    }

    pub fn create_calls(&self) -> usize {
        self.create_calls.load(Ordering::Relaxed)
    }

    pub fn inject_faults(&self, mode: FaultMode, count: usize) -> usize {
        let mut inner = self.lock();
        if count > 0 {
            inner.faults.push_back((mode, count));
        }
        pending(&inner)
    }

    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Consumes one pending fault, if any.
    pub fn next_fault(&self) -> Option<FaultMode> {
        let mut inner = self.lock();
        let (mode, remaining) = inner.faults.front_mut()?;
        let mode = *mode;
        *remaining -= 1;
        if *remaining == 0 {
            inner.faults.pop_front();
        }
        Some(mode)
    }

    pub fn payment_intents(&self) -> Vec<PaymentIntent> {
        self.lock().intents.clone()
    }

    pub fn get(&self, id: &str) -> Option<PaymentIntent> {
        let inner = self.lock();
        inner
            .by_id
            .get(id)
            .and_then(|&i| inner.intents.get(i))
            .cloned()
    }

    /// Newest-first page after `starting_after` (which must exist), filtered by customer.
    /// Returns `None` if `starting_after` is unknown, else the page and `has_more`.
    pub fn list(
        &self,
        limit: usize,
        starting_after: Option<&str>,
        customer: Option<&str>,
    ) -> Option<(Vec<PaymentIntent>, bool)> {
        let inner = self.lock();
        // Insertion order is creation order, so reverse index order is newest first with
        // ties on `created` broken deterministically.
        let start = match starting_after {
            Some(id) => *inner.by_id.get(id)?,
            None => inner.intents.len(),
        };
        let mut page: Vec<PaymentIntent> = inner.intents[..start]
            .iter()
            .rev()
            .filter(|pi| customer.is_none() || pi.customer.as_deref() == customer)
            .take(limit + 1)
            .cloned()
            .collect();
        let has_more = page.len() > limit;
        page.truncate(limit);
        Some((page, has_more))
    }

    /// Newest-first PaymentIntents matching `pred`.
    pub fn search(&self, pred: impl Fn(&PaymentIntent) -> bool) -> Vec<PaymentIntent> {
        self.lock()
            .intents
            .iter()
            .rev()
            .filter(|pi| pred(pi))
            .cloned()
            .collect()
    }

    /// Presents an idempotency key with the request's (sorted) parameters.
    pub fn begin(self: &Arc<Self>, scope: Option<Scope>, params: Vec<(String, String)>) -> Begin {
        let Some(scope) = scope else {
            return Begin::Execute(Reservation {
                state: Arc::clone(self),
                scope: None,
            });
        };
        let window = self.config.idempotency_window;
        let mut inner = self.lock();
        prune_expired(&mut inner, window);
        // An expired key is forgotten (a new request executes), unless it is still in flight.
        if let Some(entry) = inner.keys.get(&scope)
            && (entry.first_used.elapsed() < window || matches!(entry.state, KeyState::InFlight))
        {
            return match &entry.state {
                _ if entry.params != params => Begin::Mismatch,
                KeyState::InFlight => Begin::InUse,
                KeyState::Done(stored) => Begin::Replay(stored.clone()),
            };
        }
        let now = Instant::now();
        inner.keys.insert(
            scope.clone(),
            KeyEntry {
                params,
                first_used: now,
                state: KeyState::InFlight,
            },
        );
        inner.key_order.push_back((now, scope.clone()));
        Begin::Execute(Reservation {
            state: Arc::clone(self),
            scope: Some(scope),
        })
    }

    /// Records a PaymentIntent and, in the same critical section, freezes `response` under
    /// the reservation's idempotency key. `respond` builds the response from the recorded PI.
    pub fn record(
        &self,
        pi: PaymentIntent,
        mut reservation: Reservation,
        respond: impl FnOnce(&PaymentIntent) -> StoredResponse,
    ) -> StoredResponse {
        let mut inner = self.lock();
        let response = respond(&pi);
        let index = inner.intents.len();
        inner.by_id.insert(pi.id.clone(), index);
        inner.intents.push(pi);
        if let Some(scope) = reservation.scope.take()
            && let Some(entry) = inner.keys.get_mut(&scope)
        {
            entry.state = KeyState::Done(response.clone());
        }
        response
    }
}

fn pending(inner: &Inner) -> usize {
    inner
        .faults
        .iter()
        .map(|(_, n)| *n)
        .fold(0, usize::saturating_add)
}

/// Drops expired keys from the front of the first-use queue. Lookups check expiry
/// themselves; this only bounds memory during long load tests.
fn prune_expired(inner: &mut Inner, window: std::time::Duration) {
    while let Some((first_used, scope)) = inner.key_order.front() {
        if first_used.elapsed() < window {
            break;
        }
        match inner.keys.get(scope) {
            // Still executing (latency longer than the window): keep it, retry pruning later.
            Some(e) if e.first_used == *first_used && matches!(e.state, KeyState::InFlight) => {
                break;
            }
            Some(e) if e.first_used == *first_used => {
                let scope = scope.clone();
                inner.keys.remove(&scope);
            }
            _ => {}
        }
        inner.key_order.pop_front();
    }
}
