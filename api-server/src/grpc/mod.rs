//! The gRPC transport: reads metadata (credentials, idempotency key), converts requests into
//! domain values with `TryFrom`, calls `crate::rides`, and maps every domain result to a response
//! or a `Status` in one exhaustive match. Nothing here decides business outcomes.

mod status;
mod wait;

use std::{
    future::Future,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::{Duration, Instant},
};

use opentelemetry::trace::TraceContextExt;
use proto::v1::{
    CreateRideRequest, CreateRideResponse, GetRideRequest, Ride, ride_service_server::RideService,
};
use schema::models::User;
use telemetry::attr;
use tokio_util::task::TaskTracker;
use tonic::{
    Request, Response, Status,
    metadata::{MetadataMap, MetadataValue},
};
use tracing::{Instrument, Span, field};
use tracing_opentelemetry::OpenTelemetrySpanExt;

use contract::{Outcome, RideView};

use crate::{
    App,
    admission::{
        Admission, Unverified,
        lookup::LookupError,
        peer::{PeerInfo, PeerKey},
        shares::SharePermit,
    },
    auth::{self, Caller},
    config::Secret,
    idempotency::{self, IdempotencyKey, WaitBudget},
    limits::CreatePermit,
    metrics::{self, metrics},
    penalty::Penalties,
    rides::{CreateRideReply, FieldViolation, RideParams, Rides},
};

pub use status::{ERROR_DOMAIN, reason};
pub use wait::IDEMPOTENCY_WAIT_HEADER;

// The metadata names are the wire contract, defined once in `proto::metadata`.
pub use proto::metadata::{
    IDEMPOTENCY_KEY as IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_KEY_EXPIRES_AT as EXPIRES_AT_HEADER,
    IDEMPOTENT_REPLAYED as REPLAYED_HEADER, ON_BEHALF_OF_USER as ON_BEHALF_OF_HEADER,
};
/// The retry hint when the token-lookup queue is full: lookups take milliseconds.
const LOOKUP_RETRY: Duration = Duration::from_millis(200);
/// The retry hint when a service holds its share of CreateRides in flight: about one provider
/// call.
const SHARE_RETRY: Duration = Duration::from_secs(1);

/// What an admitted CreateRide holds until its attempt ends: its user's concurrency place and, for
/// a certificate-authenticated service, a place in that service's share.
type CreatePermits = (CreatePermit, Option<SharePermit>);

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
    _admission_gauges: [opentelemetry::metrics::ObservableGauge<u64>; 2],
}

/// A caller that passed admission (its credential verified, lately or now), with its
/// CreateRide concurrency permit.
struct Admitted<P> {
    caller: Caller,
    permit: P,
}

/// Where a call comes from: its connection, its client (its own address, the one a trusted proxy
/// names, or its certificate), and whom its refusals count against (that client; nobody for the
/// internal credential). Worked out once per call.
struct CallPeer {
    info: PeerInfo,
    client: Option<PeerKey>,
    key: Option<PeerKey>,
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

    fn call_peer<T>(&self, request: &Request<T>) -> CallPeer {
        let info = request
            .extensions()
            .get::<PeerInfo>()
            .cloned()
            .unwrap_or_default();
        let metadata = request.metadata();
        let internal = bearer(metadata).is_ok_and(|token| self.is_internal(token));
        let client = self.admission.peer_key(&info, metadata);
        let key = if internal { None } else { client };
        CallPeer { info, client, key }
    }

    /// Counts a call that failed authentication against its peer; nothing else counts.
    fn note_failed_auth<T>(&self, peer: &CallPeer, result: &Result<Response<T>, Status>) {
        if let Err(status) = result
            && matches!(
                status.code(),
                tonic::Code::Unauthenticated | tonic::Code::PermissionDenied
            )
        {
            metrics::refused("failed_auth");
            self.admission.failed_auth(peer.key);
        }
    }

    fn is_internal(&self, token: &str) -> bool {
        self.internal_api_token
            .as_ref()
            .is_some_and(|internal| auth::is_internal_token(token, internal.expose()))
    }

    /// Who is calling, as far as memory can tell: every credential check that needs no database,
    /// in the contract's order. A token that cannot be one of ours, or that was looked up lately
    /// and belongs to nobody, is refused here.
    fn identify(&self, metadata: &MetadataMap) -> Result<Caller, Status> {
        self.caller(bearer(metadata)?, metadata)
    }

    /// The caller that presents `token`, in the contract's order of checks.
    fn caller(&self, token: &str, metadata: &MetadataMap) -> Result<Caller, Status> {
        match (self.is_internal(token), metadata.get(ON_BEHALF_OF_HEADER)) {
            (false, None) => {
                if !auth::is_token_shaped(token) {
                    return Err(status::invalid_credentials());
                }
                let digest = auth::token_digest(token);
                if self.admission.is_unknown(&digest) {
                    return Err(status::invalid_credentials());
                }
                Ok(Caller::Token(digest))
            }
            (false, Some(_)) => Err(status::on_behalf_of_not_allowed()),
            (true, None) => Err(status::on_behalf_of_required()),
            (true, Some(user_id)) => user_id
                .to_str()
                .ok()
                .and_then(|id| id.parse::<i64>().ok())
                .map(Caller::OnBehalfOf)
                .ok_or_else(status::on_behalf_of_required),
        }
    }

    /// Admits a call: not from a client address shut out behind a trusted proxy, under its
    /// user's `limit`, and with its credential verified (from memory, or by a queued lookup).
    /// An admitted call vouches for its peer (`crate::penalty`).
    async fn admit<P>(
        &self,
        peer: &CallPeer,
        caller: Result<Caller, Status>,
        limit: impl FnOnce(Caller) -> Result<P, Status>,
    ) -> Result<Admitted<P>, Status> {
        if let Some(cooldown) = self.admission.shut_out_for(peer.key) {
            metrics::refused("shut_out");
            return Err(status::rate_limited(
                "too many failed authentications from this address; retry later",
                cooldown,
            ));
        }
        let caller = caller?;
        let permit = limit(caller)?;
        self.admission
            .verify(caller, peer.key)
            .await
            .map_err(|unverified| match unverified {
                Unverified::ServiceShare => {
                    metrics::refused("service_share");
                    status::rate_limited(
                        "this service holds its share of the token lookups; retry later",
                        LOOKUP_RETRY,
                    )
                }
                Unverified::UnknownToken => status::invalid_credentials(),
                Unverified::Lookup(LookupError::Busy) => {
                    metrics::refused("lookup_busy");
                    status::rate_limited(
                        "too many calls with tokens not verified lately; retry later",
                        LOOKUP_RETRY,
                    )
                }
                Unverified::Lookup(LookupError::Unavailable) => status::database_unavailable(),
            })?;
        self.admission.vouch(peer.key, &peer.info);
        Ok(Admitted { caller, permit })
    }

    /// Admits a CreateRide under its user's rate and concurrency, and its service's share.
    async fn admit_create(
        &self,
        metadata: &MetadataMap,
        peer: &CallPeer,
    ) -> Result<Admitted<CreatePermits>, Status> {
        let admission = &self.admission;
        self.admit(peer, self.identify(metadata), |caller| {
            let user = admission.limiter.admit_create(caller).map_err(|refusal| {
                metrics::refused("user_rate");
                status::rate_limited(
                    "too many CreateRide calls for this user; retry later",
                    refusal.retry_after,
                )
            })?;
            let service = admission.take_create_share(peer.key).map_err(|_| {
                metrics::refused("service_share");
                status::rate_limited(
                    "this service holds its share of the CreateRides in flight; retry later",
                    SHARE_RETRY,
                )
            })?;
            Ok((user, service))
        })
        .await
    }

    /// Admits a GetRide under its user's rate. The internal credential is for CreateRide only:
    /// the completer never reads rides.
    async fn admit_get(
        &self,
        metadata: &MetadataMap,
        peer: &CallPeer,
    ) -> Result<Admitted<()>, Status> {
        let token = bearer(metadata);
        let caller = match token {
            Ok(token) if self.is_internal(token) => Err(status::internal_credential_not_allowed()),
            Ok(token) => self.caller(token, metadata),
            Err(status) => Err(status),
        };
        let limiter = &self.admission.limiter;
        self.admit(peer, caller, |caller| {
            limiter.admit_get(caller).map_err(|refusal| {
                metrics::refused("user_rate");
                status::rate_limited(
                    "too many GetRide calls for this user; retry later",
                    refusal.retry_after,
                )
            })
        })
        .await
    }

    /// The caller's user: the owner of a user token, or, for the internal credential, the user
    /// named in `on-behalf-of-user`.
    async fn authenticate(&self, caller: Caller) -> Result<User, Status> {
        let user = match caller {
            Caller::Token(digest) => auth::user_by_token_digest(self.rides.pool(), &digest).await,
            Caller::OnBehalfOf(user_id) => auth::user_by_id(self.rides.pool(), user_id).await,
        }
        .map_err(status::store_error)?;
        match user {
            Some(user) => {
                self.admission.known(caller, user.id);
                Ok(user)
            }
            None => {
                self.admission.unknown(caller);
                Err(status::invalid_credentials())
            }
        }
    }

    /// Refuses a new key of a caller whose decline budget is spent (`crate::limits`); a key that
    /// exists (a replay, or a resumption) goes on. The lookup is made only for such a caller.
    async fn check_decline_budget(
        &self,
        caller: Caller,
        key: &Result<IdempotencyKey, Status>,
    ) -> Result<(), Status> {
        let (Some(refusal), Ok(key)) = (self.admission.limiter.decline_budget_spent(caller), key)
        else {
            return Ok(());
        };
        let exists = idempotency::key_exists(self.rides.pool(), caller, key)
            .await
            .map_err(status::store_error)?;
        if exists {
            return Ok(());
        }
        metrics::refused("decline_budget");
        Err(status::rate_limited(
            "too many declined cards lately: new idempotency keys are refused for a while",
            refusal.retry_after,
        ))
    }
}

impl TryFrom<CreateRideRequest> for RideParams {
    type Error = Vec<FieldViolation>;

    fn try_from(request: CreateRideRequest) -> Result<RideParams, Self::Error> {
        RideParams::new(
            request.origin_lat,
            request.origin_lon,
            request.target_lat,
            request.target_lon,
        )
    }
}

/// A ride as the API message carries it (the view lives in `contract`, the message in `proto`,
/// so this cannot be a `From`).
fn ride_message(ride: RideView) -> Ride {
    Ride {
        id: ride.id,
        origin_lat: ride.origin_lat,
        origin_lon: ride.origin_lon,
        target_lat: ride.target_lat,
        target_lon: ride.target_lon,
        charge_id: ride.charge_id.unwrap_or_default(),
        amount: ride.amount,
        currency: ride.currency,
        created_at: Some(prost_types::Timestamp {
            seconds: ride.created_at.timestamp(),
            // Always below 2e9, so the conversion cannot fail.
            nanos: i32::try_from(ride.created_at.timestamp_subsec_nanos()).unwrap_or(0),
        }),
    }
}

/// The validated key from `idempotency-key` metadata, or the `INVALID_IDEMPOTENCY_KEY` status.
///
/// Public only so that the fuzz target `idempotency_key` (in `fuzz/`, outside the workspace) runs
/// exactly what a CreateRide call does with the metadata value.
pub fn idempotency_key(metadata: &MetadataMap) -> Result<IdempotencyKey, Status> {
    let raw = metadata
        .get(IDEMPOTENCY_KEY_HEADER)
        .ok_or_else(|| status::invalid_key("the idempotency-key metadata is required"))?;
    let raw = raw
        .to_str()
        .map_err(|_| status::invalid_key("the idempotency-key must be visible ASCII"))?;
    IdempotencyKey::parse(raw).map_err(|error| status::invalid_key(&error.to_string()))
}

/// Reads a W3C trace context from gRPC metadata.
struct MetadataExtractor<'a>(&'a MetadataMap);

impl opentelemetry::propagation::Extractor for MetadataExtractor<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|value| value.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0
            .keys()
            .filter_map(|key| match key {
                tonic::metadata::KeyRef::Ascii(key) => Some(key.as_str()),
                tonic::metadata::KeyRef::Binary(_) => None,
            })
            .collect()
    }
}

/// The token of the `authorization: Bearer <token>` metadata.
fn bearer(metadata: &MetadataMap) -> Result<&str, Status> {
    metadata
        .get(proto::metadata::AUTHORIZATION)
        .ok_or_else(status::missing_credentials)?
        .to_str()
        .ok()
        .and_then(auth::bearer_token)
        .ok_or_else(status::invalid_credentials)
}

/// The server span of one RPC. It continues the caller's trace context only if `trusted` (an
/// authenticated caller); otherwise it is a root, linked to the caller's context. The parent must
/// be chosen here, before the span is first entered.
fn rpc_span(method: &'static str, caller_trace: opentelemetry::Context, trusted: bool) -> Span {
    let span = tracing::info_span!(
        "rpc",
        otel.name = %format_args!("rides.v1.RideService/{method}"),
        otel.kind = "server",
        otel.status_code = field::Empty,
        rpc.system = "grpc",
        rpc.service = "rides.v1.RideService",
        rpc.method = method,
        rpc.grpc.status_code = field::Empty,
        trace_id = field::Empty,
        user.id = field::Empty,
        rides.idempotency_key = field::Empty,
        rides.replayed = field::Empty,
    );
    let caller = caller_trace.span().span_context().clone();
    if caller.is_valid() {
        if trusted {
            let _ = span.set_parent(caller_trace);
        } else {
            span.add_link(caller);
        }
    }
    telemetry::record_trace_id(&span);
    span
}

/// Runs one RPC inside its server span, and records its status code on the span and in
/// `rpc.server.call.duration` (from `started`, so admission's wait is counted).
async fn traced<T>(
    method: &'static str,
    started: Instant,
    span: Span,
    handler: impl Future<Output = Result<Response<T>, Status>>,
) -> Result<Response<T>, Status> {
    let result = handler.instrument(span.clone()).await;
    let code = match &result {
        Ok(_) => tonic::Code::Ok,
        Err(status) => status.code(),
    };
    span.record("rpc.grpc.status_code", code as i64);
    if matches!(
        code,
        tonic::Code::Internal | tonic::Code::Unavailable | tonic::Code::Unknown
    ) {
        span.record("otel.status_code", "ERROR");
    }
    metrics().rpc_duration.record(
        started.elapsed().as_secs_f64(),
        &[
            attr("rpc.system", "grpc"),
            attr("rpc.method", method),
            attr("rpc.grpc.status_code", code as i64),
        ],
    );
    result
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
        let span = server_span("CreateRide", request.metadata(), admitted.is_ok());
        let handler = self.create_ride_traced(request, &peer, admitted, started);
        let result = traced("CreateRide", started, span, handler).await;
        self.note_failed_auth(&peer, &result);
        result
    }

    async fn get_ride(&self, request: Request<GetRideRequest>) -> Result<Response<Ride>, Status> {
        let started = Instant::now();
        let peer = self.call_peer(&request);
        let admitted = self.admit_get(request.metadata(), &peer).await;
        let span = server_span("GetRide", request.metadata(), admitted.is_ok());
        let handler = self.get_ride_traced(request, admitted);
        let result = traced("GetRide", started, span, handler).await;
        self.note_failed_auth(&peer, &result);
        result
    }
}

/// The RPC's server span. Only an admitted caller (its credential verified) may continue its own
/// trace, choosing the trace id and the sampling decision; anyone else's is a linked root.
fn server_span(method: &'static str, metadata: &MetadataMap, admitted: bool) -> Span {
    let caller_trace = telemetry::extract(&MetadataExtractor(metadata));
    rpc_span(method, caller_trace, admitted)
}

impl RideApi {
    async fn create_ride_traced(
        &self,
        request: Request<CreateRideRequest>,
        peer: &CallPeer,
        admitted: Result<Admitted<CreatePermits>, Status>,
        started: Instant,
    ) -> Result<Response<CreateRideResponse>, Status> {
        let fresh = |mut status: Status| {
            status
                .metadata_mut()
                .insert(REPLAYED_HEADER, MetadataValue::from_static("false"));
            status
        };
        let Admitted { caller, permit } = admitted.map_err(fresh)?;
        let origin_ip = peer
            .info
            .client_ip(peer.client)
            .unwrap_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED));
        let key = idempotency_key(request.metadata());
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
        // The permit moves into the detached attempt: a client that hangs up does not free its
        // place while its attempt still runs. A waiting call holds it too: it counts against
        // its caller's concurrency.
        let answered = self
            .detached(async move {
                let _permit = permit;
                rides
                    .create_ride(caller, &key, params, origin_ip, &wait)
                    .await
            })
            .await
            .map_err(fresh)?;
        let Some((user_id, reply)) = answered else {
            self.admission.unknown(caller);
            return Err(fresh(status::invalid_credentials()));
        };
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
        into_response(reply)
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

/// The one place a CreateRide result becomes a gRPC answer, for fresh and replayed outcomes alike.
fn into_response(reply: CreateRideReply) -> Result<Response<CreateRideResponse>, Status> {
    let stamp = |metadata: &mut MetadataMap| {
        metadata.insert(
            REPLAYED_HEADER,
            MetadataValue::from_static(if reply.replayed { "true" } else { "false" }),
        );
        if let Some(expires_at) = reply.key_expires_at
            && let Ok(value) = expires_at
                .to_rfc3339_opts(chrono::SecondsFormat::Millis, true)
                .parse()
        {
            metadata.insert(EXPIRES_AT_HEADER, value);
        }
    };
    let result = match reply.result {
        Ok(Outcome::RideCreated { ride, message }) => Ok(CreateRideResponse {
            ride: Some(ride_message(ride)),
            message,
        }),
        Ok(Outcome::CardDeclined {
            message,
            decline_code,
        }) => Err(status::card_declined(&message, decline_code.as_deref())),
        Ok(Outcome::PaymentRefunded { message, .. }) => Err(status::payment_refunded(&message)),
        Err(error) => Err(status::create_ride_error(error)),
    };
    match result {
        Ok(body) => {
            let mut response = Response::new(body);
            stamp(response.metadata_mut());
            Ok(response)
        }
        Err(mut status) => {
            stamp(status.metadata_mut());
            Err(status)
        }
    }
}
