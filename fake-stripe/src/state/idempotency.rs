//! Stripe's idempotency keys as fake-stripe keeps them: scoped per API key, the first request's
//! parameters compared with every retry's, a key in flight answered 409, a finished one replayed
//! verbatim within the window, and forgotten after it.

use std::{sync::Arc, time::Instant};

use super::{Inner, PaymentIntent, State, StoredResponse};

/// Idempotency keys are scoped per API key, as at Stripe: `(api key, idempotency key)`.
pub(crate) type Scope = (String, String);

pub(super) enum KeyState {
    InFlight,
    Done(StoredResponse),
}

pub(super) struct KeyEntry {
    /// Sorted form parameters of the first request, compared order-insensitively.
    pub(super) params: Vec<(String, String)>,
    /// The window is measured from the key's first use, not from its last replay.
    pub(super) first_used: Instant,
    pub(super) state: KeyState,
}

/// Outcome of presenting an idempotency key.
pub(crate) enum Begin {
    /// First use (or first use after expiry): go ahead and execute.
    Execute(Reservation),
    Replay(StoredResponse),
    Mismatch,
    InUse,
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

impl State {
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
        inner.freeze(&mut reservation, &response);
        response
    }
}

/// Drops expired keys from the front of the first-use queue. Lookups check expiry
/// themselves; this only bounds memory during long load tests.
pub(super) fn prune_expired(inner: &mut Inner, window: std::time::Duration) {
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

impl Inner {
    /// Freezes `response` under the reservation's idempotency key (replayed verbatim from now on),
    /// in the critical section that recorded what it describes.
    pub(super) fn freeze(&mut self, reservation: &mut Reservation, response: &StoredResponse) {
        if let Some(scope) = reservation.scope.take()
            && let Some(entry) = self.keys.get_mut(&scope)
        {
            entry.state = KeyState::Done(response.clone());
        }
    }
}
