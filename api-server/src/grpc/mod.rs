//! The gRPC transport: the `RideService` methods, each admitted (`admit.rs`: the peer, its
//! credential, its permits and the decline budget, applying `crate::admission`'s rules), traced
//! (`span.rs`), converted (`convert.rs`: `TryFrom` into domain values, `into_response` back), and
//! run by `crate::rides`; every domain error becomes a `Status` in one exhaustive match
//! (`status.rs`). Nothing here decides business outcomes.

mod admit;
mod convert;
mod span;
mod status;
mod wait;

use std::{
    future::Future,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::{Duration, Instant},
};

use proto::v1::{
    CreateRideRequest, CreateRideResponse, GetRideRequest, Ride, ride_service_server::RideService,
};
use tokio_util::task::TaskTracker;
use tonic::{Request, Response, Status, metadata::MetadataValue};
use tracing::{Instrument, Span};

use contract::Outcome;

use crate::{
    App,
    admission::Admission,
    auth::Caller,
    config::Secret,
    idempotency::WaitBudget,
    metrics::{self},
    penalty::Penalties,
    rides::{Begun, CreateRideReply, RideParams, Rides},
};

use self::{admit::*, convert::*, span::*};

pub use convert::idempotency_key;
pub use status::{ERROR_DOMAIN, reason};
pub use wait::IDEMPOTENCY_WAIT_HEADER;

// The metadata names are the wire contract, defined once in `proto::metadata`.
pub use proto::metadata::{
    IDEMPOTENCY_KEY as IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_KEY_EXPIRES_AT as EXPIRES_AT_HEADER,
    IDEMPOTENT_REPLAYED as REPLAYED_HEADER, ON_BEHALF_OF_USER as ON_BEHALF_OF_HEADER,
};
/// The `rides.v1.RideService` implementation.
pub struct RideApi {
    rides: Arc<Rides>,
    internal_api_token: Option<Secret>,
    /// CreateRide runs in tasks tracked here, so that shutdown can wait for them.
    tasks: TaskTracker,
    admission: Arc<Admission>,
    /// The server's own deadline for a call (`GRPC_REQUEST_TIMEOUT_SECS`): a duplicate's wait
    /// ends before it, as before the call's `grpc-timeout`.
    request_timeout: Duration,
    _admission_gauges: [opentelemetry::metrics::ObservableGauge<u64>; 5],
}

impl RideApi {
    pub fn new(app: App, tasks: TaskTracker, penalties: Arc<Penalties>) -> RideApi {
        let admission = Arc::new(Admission::new(
            app.rides.pool().clone(),
            app.pool_size,
            app.limits,
            penalties,
            app.trusted_proxies.clone(),
        ));
        RideApi {
            rides: app.rides,
            internal_api_token: app.internal_api_token,
            tasks,
            request_timeout: app.transport.request_timeout,
            _admission_gauges: metrics::observe_admission(&admission),
            admission,
        }
    }
}

#[tonic::async_trait]
impl RideService for RideApi {
    async fn create_ride(
        &self,
        request: Request<CreateRideRequest>,
    ) -> Result<Response<CreateRideResponse>, Status> {
        let started = Instant::now();
        let peer = self.call_peer(&request);
        let admitted = self.admit_create(request.metadata(), &peer).await;
        let span = server_span(CREATE_RIDE, request.metadata(), admitted.is_ok());
        let handler = self.create_ride_traced(request, &peer, admitted, started);
        let result = traced(CREATE_RIDE, started, span, handler).await;
        self.note_failed_auth(&peer, &result);
        result
    }

    async fn get_ride(&self, request: Request<GetRideRequest>) -> Result<Response<Ride>, Status> {
        let started = Instant::now();
        let peer = self.call_peer(&request);
        let admitted = self.admit_get(request.metadata(), &peer).await;
        let span = server_span(GET_RIDE, request.metadata(), admitted.is_ok());
        let handler = self.get_ride_traced(request, admitted);
        let result = traced(GET_RIDE, started, span, handler).await;
        self.note_failed_auth(&peer, &result);
        result
    }
}

impl RideApi {
    async fn create_ride_traced(
        &self,
        request: Request<CreateRideRequest>,
        peer: &CallPeer,
        admitted: Result<Admitted<CreatePermits>, Status>,
        started: Instant,
    ) -> Result<Response<CreateRideResponse>, Status> {
        let Admitted { caller, permit } = admitted.map_err(fresh)?;
        let origin_ip = peer
            .info
            .client_ip(peer.client)
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let key = idempotency_key(request.metadata());
        let resent = convert::key_resent(request.metadata());
        self.check_on_behalf_of_key(caller, &key)
            .await
            .map_err(fresh)?;
        self.check_decline_budget(caller, &key)
            .await
            .map_err(fresh)?;
        let requested_wait = wait::requested_wait(request.metadata());
        let (metadata, _, message) = request.into_parts();
        let params = RideParams::try_from(message);
        // Checked in the contract's order: credentials first, then the key, its wait, then the
        // parameters. The credentials of a valid request are checked by the claim's own
        // statement; those of an invalid one need a lookup of their own.
        let valid = match (key, requested_wait, params) {
            (Ok(key), Ok(requested), Ok(params)) => Ok((key, requested, params)),
            (Err(invalid_key), _, _) => Err(invalid_key),
            (Ok(_), Err(invalid_wait), _) => Err(invalid_wait),
            (Ok(_), Ok(_), Err(violations)) => Err(status::invalid_params(&violations)),
        };
        let (key, requested_wait, params) = match valid {
            Ok(valid) => valid,
            Err(invalid) => {
                let user = self.authenticate(caller).await.map_err(fresh)?;
                Span::current().record("user.id", user.id);
                return Err(fresh(invalid));
            }
        };
        Span::current().record("rides.idempotency_key", key.redacted());
        let rides = Arc::clone(&self.rides);
        let wait = WaitBudget {
            until: wait::wait_until_for(
                rides.wait_config(),
                &metadata,
                requested_wait,
                started,
                self.request_timeout,
            ),
            ..WaitBudget::none()
        };
        // A caller that hangs up (or whose deadline passes) ends its wait, not its attempt.
        let _waiting = wait.gone.clone().drop_guard();
        // A resent key's read writes nothing, so it runs here, in the call: most replays are
        // answered without the detached task (one task and its wake-ups fewer per replay).
        // The permit moves into the detached attempt: a client that hangs up does not free its
        // place while its attempt still runs. A waiting call holds it too: it counts against
        // its caller's concurrency. Boxed: the attempt's state is the largest future in the
        // service, and unboxed it is copied whole at every move (into this handler's future,
        // tonic's box, the task).
        let answered = match rides.begin(caller, &key, resent, params, origin_ip).await {
            Begun::Answered(user_id, reply) => Some((user_id, reply)),
            Begun::Attempt(attempt) => self
                .detached(Box::pin(async move {
                    let _permit = permit;
                    rides.create_ride(attempt, &wait).await
                }))
                .await
                .map_err(fresh)?,
        };
        let Some((user_id, reply)) = answered else {
            self.admission.unknown(caller);
            return Err(fresh(status::invalid_credentials()));
        };
        self.note_answer(caller, user_id, &reply).await;
        into_response(reply)
    }

    /// What admission learns from an answered CreateRide: who the caller is, and a fresh decline
    /// against its decline budget.
    async fn note_answer(&self, caller: Caller, user_id: Option<i64>, reply: &CreateRideReply) {
        if let Some(user_id) = user_id {
            self.admission.known(caller, user_id);
            Span::current().record("user.id", user_id);
        }
        Span::current().record("rides.replayed", reply.replayed);
        let fresh_decline =
            !reply.replayed && matches!(reply.result, Ok(Outcome::CardDeclined { .. }));
        let declined_user = match caller {
            Caller::OnBehalfOf(user_id) => Some(user_id),
            Caller::Token(_) => user_id,
        };
        if fresh_decline && let Some(user_id) = declined_user {
            self.admission.count_decline(caller, user_id).await;
        }
    }

    /// Runs a CreateRide attempt detached from the request: a client that hangs up must not cut
    /// a phase or a charge in half. The attempt runs to its end and unlocks the key.
    async fn detached<T: Send + 'static>(
        &self,
        attempt: impl Future<Output = T> + Send + 'static,
    ) -> Result<T, Status> {
        self.tasks
            .spawn(attempt.instrument(Span::current()))
            .await
            .map_err(|error| {
                tracing::error!(%error, "CreateRide task failed");
                status::internal()
            })
    }

    async fn get_ride_traced(
        &self,
        request: Request<GetRideRequest>,
        admitted: Result<Admitted<()>, Status>,
    ) -> Result<Response<Ride>, Status> {
        let admitted = admitted?;
        let user = self.authenticate(admitted.caller).await?;
        let ride_id = request.into_inner().id;
        self.rides
            .get_ride(user.id, ride_id)
            .await
            .map_err(status::store_error)?
            .map(|ride| Response::new(ride_message(ride)))
            .ok_or_else(status::ride_not_found)
    }
}

/// An error answered before any stored outcome was read: never a replay.
fn fresh(mut status: Status) -> Status {
    status
        .metadata_mut()
        .insert(REPLAYED_HEADER, MetadataValue::from_static("false"));
    status
}
