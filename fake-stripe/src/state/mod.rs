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

/// A Refund as Stripe serialises it (the subset of fields we model). A refunded PaymentIntent
/// stays `succeeded`, as at Stripe; what was given back is the sum of its refunds.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct Refund {
    pub id: String,
    pub object: String,
    pub amount: i64,
    pub charge: Option<String>,
    pub created: i64,
    pub currency: String,
    pub metadata: BTreeMap<String, String>,
    pub payment_intent: String,
    pub reason: Option<String>,
    pub status: String,
}

/// Why a refund cannot be made, decided against the ledger under the lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum RefundRefusal {
    NoSuchIntent,
    NotSucceeded,
    /// Nothing is left to refund.
    AlreadyRefunded,
    /// More than what is left was asked for; carries what is left.
    TooLarge(i64),
}

/// The `created` bounds of a list request (`created[gt]`, `created[gte]`, `created[lt]`,
/// `created[lte]`), in Unix seconds.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct CreatedRange {
    pub gt: Option<i64>,
    pub gte: Option<i64>,
    pub lt: Option<i64>,
    pub lte: Option<i64>,
}

impl CreatedRange {
    fn contains(&self, created: i64) -> bool {
        self.gt.is_none_or(|bound| created > bound)
            && self.gte.is_none_or(|bound| created >= bound)
            && self.lt.is_none_or(|bound| created < bound)
            && self.lte.is_none_or(|bound| created <= bound)
    }
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

#[derive(Default)]
struct Inner {
    intents: Vec<PaymentIntent>,
    by_id: HashMap<String, usize>,
    /// Every refund, oldest first.
    refunds: Vec<Refund>,
    keys: HashMap<Scope, KeyEntry>,
    /// Keys in first-use order, so expired ones can be pruned from the front cheaply.
    key_order: VecDeque<(Instant, Scope)>,
    /// Pending faults as run-length `(mode, remaining)` so a huge count costs no memory.
    faults: VecDeque<(FaultMode, usize)>,
    /// Faults aimed at one customer's charges, by customer.
    targeted: HashMap<String, (FaultMode, usize)>,
    /// How many of the next `GET /v1/payment_intents/{id}` calls answer 500 `api_error`.
    failing_retrieves: usize,
}

/// Shared server state; cloned into every connection as an `Arc`.
pub(crate) struct State {
    pub config: Config,
    create_calls: AtomicUsize,
    inner: Mutex<Inner>,
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

mod idempotency;

use self::idempotency::KeyEntry;
pub(crate) use self::idempotency::{Begin, Reservation, Scope};

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
        let mut inner = self.lock();
        inner.faults.clear();
        inner.targeted.clear();
        inner.failing_retrieves = 0;
    }

    pub fn fail_retrieves(&self, count: usize) {
        self.lock().failing_retrieves = count;
    }

    /// Whether this retrieve is one that fails (and counts it).
    pub fn retrieve_fails(&self) -> bool {
        let mut inner = self.lock();
        let fails = inner.failing_retrieves > 0;
        inner.failing_retrieves = inner.failing_retrieves.saturating_sub(1);
        fails
    }

    /// Replaces `customer`'s pending faults with `count` of `mode` (0 clears them); returns
    /// how many are pending for that customer.
    pub fn inject_faults_for(&self, customer: &str, mode: FaultMode, count: usize) -> usize {
        let mut inner = self.lock();
        if count == 0 {
            inner.targeted.remove(customer);
        } else {
            inner.targeted.insert(customer.to_owned(), (mode, count));
        }
        count
    }

    /// Consumes one of `customer`'s pending faults, if any.
    pub fn next_fault_for(&self, customer: &str) -> Option<FaultMode> {
        let mut inner = self.lock();
        let (mode, remaining) = inner.targeted.get_mut(customer)?;
        let mode = *mode;
        *remaining -= 1;
        if *remaining == 0 {
            inner.targeted.remove(customer);
        }
        Some(mode)
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

    /// Newest-first page after `starting_after` (which must exist), filtered by customer and
    /// by `created`. Returns `None` if `starting_after` is unknown, else the page and `has_more`.
    pub fn list(
        &self,
        limit: usize,
        starting_after: Option<&str>,
        customer: Option<&str>,
        created: CreatedRange,
    ) -> Option<(Vec<PaymentIntent>, bool)> {
        let inner = self.lock();
        // The ledger is kept in `created` order (ties in insertion order, see `backdate`), so
        // reverse index order is newest first with ties broken deterministically.
        let start = match starting_after {
            Some(id) => *inner.by_id.get(id)?,
            None => inner.intents.len(),
        };
        Some(newest_first(&inner.intents[..start], limit, |pi| {
            (customer.is_none() || pi.customer.as_deref() == customer)
                && created.contains(pi.created)
        }))
    }

    /// Moves a PaymentIntent's `created` (a test hook: Stripe cannot do this), keeping the ledger
    /// in `created` order so that lists stay newest first. Returns false for an unknown id.
    pub fn backdate(&self, id: &str, created: i64) -> bool {
        let mut inner = self.lock();
        let Some(&index) = inner.by_id.get(id) else {
            return false;
        };
        if let Some(pi) = inner.intents.get_mut(index) {
            pi.created = created;
        }
        // A stable sort keeps insertion order among equal timestamps.
        inner.intents.sort_by_key(|pi| pi.created);
        let by_id = inner
            .intents
            .iter()
            .enumerate()
            .map(|(index, pi)| (pi.id.clone(), index))
            .collect();
        inner.by_id = by_id;
        true
    }

    /// What the refunds of a PaymentIntent gave back, in total (Stripe's `amount_refunded` of
    /// its charge).
    pub fn amount_refunded(&self, payment_intent: &str) -> i64 {
        self.lock()
            .refunds
            .iter()
            .filter(|refund| refund.payment_intent == payment_intent)
            .map(|refund| refund.amount)
            .sum()
    }

    /// Every refund, oldest first.
    pub fn refunds(&self) -> Vec<Refund> {
        self.lock().refunds.clone()
    }

    /// Newest-first page of refunds after `starting_after` (which must exist), filtered by
    /// PaymentIntent. `None` if `starting_after` is unknown.
    pub fn list_refunds(
        &self,
        limit: usize,
        starting_after: Option<&str>,
        payment_intent: Option<&str>,
    ) -> Option<(Vec<Refund>, bool)> {
        let inner = self.lock();
        let start = match starting_after {
            Some(id) => inner.refunds.iter().position(|refund| refund.id == id)?,
            None => inner.refunds.len(),
        };
        Some(newest_first(&inner.refunds[..start], limit, |refund| {
            payment_intent.is_none_or(|pi| refund.payment_intent == pi)
        }))
    }

    /// Refunds `amount` (everything left when `None`) of a succeeded PaymentIntent, and, in the
    /// same critical section, freezes the response under the reservation's idempotency key. A
    /// refusal stores nothing: the reservation is dropped, which frees the key.
    pub fn refund(
        &self,
        payment_intent: &str,
        amount: Option<i64>,
        reason: Option<String>,
        metadata: BTreeMap<String, String>,
        mut reservation: Reservation,
        respond: impl FnOnce(&Refund) -> StoredResponse,
    ) -> Result<StoredResponse, RefundRefusal> {
        let mut inner = self.lock();
        let pi = inner
            .by_id
            .get(payment_intent)
            .and_then(|&index| inner.intents.get(index))
            .ok_or(RefundRefusal::NoSuchIntent)?;
        if pi.status != "succeeded" {
            return Err(RefundRefusal::NotSucceeded);
        }
        let refunded: i64 = inner
            .refunds
            .iter()
            .filter(|refund| refund.payment_intent == payment_intent)
            .map(|refund| refund.amount)
            .sum();
        let left = pi.amount_received - refunded;
        if left <= 0 {
            return Err(RefundRefusal::AlreadyRefunded);
        }
        let amount = amount.unwrap_or(left);
        if amount > left {
            return Err(RefundRefusal::TooLarge(left));
        }
        let refund = Refund {
            id: random_id("re_", self.config.refund_id_len),
            object: "refund".to_owned(),
            amount,
            charge: pi.latest_charge.clone(),
            created: chrono::Utc::now().timestamp(),
            currency: pi.currency.clone(),
            metadata,
            payment_intent: payment_intent.to_owned(),
            reason,
            status: "succeeded".to_owned(),
        };
        let response = respond(&refund);
        inner.refunds.push(refund);
        inner.freeze(&mut reservation, &response);
        Ok(response)
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
}

/// One page of a list: the `older` items (oldest first) that `keep` accepts, newest first, at
/// most `limit`, and whether more follow.
fn newest_first<T: Clone>(older: &[T], limit: usize, keep: impl Fn(&T) -> bool) -> (Vec<T>, bool) {
    let mut page: Vec<T> = older
        .iter()
        .rev()
        .filter(|item| keep(item))
        .take(limit + 1)
        .cloned()
        .collect();
    let has_more = page.len() > limit;
    page.truncate(limit);
    (page, has_more)
}

fn pending(inner: &Inner) -> usize {
    inner
        .faults
        .iter()
        .map(|(_, n)| *n)
        .fold(0, usize::saturating_add)
}
