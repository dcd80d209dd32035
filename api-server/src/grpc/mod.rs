//! The gRPC transport: reads metadata (credentials, idempotency key), converts requests into
//! domain values with `TryFrom`, calls `crate::rides`, and maps every domain result to a response
//! or a `Status` in one exhaustive match. Nothing here decides business outcomes.

mod status;

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
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
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
    auth::{self, Caller},
    config::Secret,
    idempotency::{self, IdempotencyKey},
    limits::{CreatePermit, DigestCache, Limiter},
    metrics::metrics,
    penalty::Penalties,
    rides::{CreateRideReply, FieldViolation, RideParams, Rides},
};

pub use status::{ERROR_DOMAIN, reason};

// The metadata names are the wire contract, defined once in `proto::metadata`.
pub use proto::metadata::{
    IDEMPOTENCY_KEY as IDEMPOTENCY_KEY_HEADER, IDEMPOTENCY_KEY_EXPIRES_AT as EXPIRES_AT_HEADER,
    IDEMPOTENT_REPLAYED as REPLAYED_HEADER, ON_BEHALF_OF_USER as ON_BEHALF_OF_HEADER,
};
/// The retry hint when every token-lookup place is taken: a lookup takes milliseconds.
const LOOKUP_RETRY: Duration = Duration::from_millis(200);

/// The `rides.v1.RideService` implementation.
pub struct RideApi {
    rides: Arc<Rides>,
    internal_api_token: Option<Secret>,
    /// CreateRide runs in tasks tracked here, so that shutdown can wait for them.
    tasks: TaskTracker,
    limiter: Limiter,
    /// Digests no user has: refused from memory for a while (`crate::limits`).
    unknown_tokens: DigestCache,
    /// Digests authenticated lately: their callers' trace context is trusted without a lookup,
    /// and their calls need no [`RideApi::token_lookups`] permit.
    known_tokens: DigestCache,
    /// Calls whose token has not been verified lately each cost a database lookup (the claim
    /// statement, or a read): at most this many run at once, so a flood of made-up well-shaped
    /// tokens cannot take the pool and the database from users whose tokens are known.
    token_lookups: Arc<Semaphore>,
    /// Peers whose calls keep being refused are shut out (`crate::penalty`).
    penalties: Arc<Penalties>,
}

/// A caller that passed the checks made in memory, with its CreateRide concurrency permit and,
/// for a token not verified lately, its place among the token lookups.
struct Admitted<P> {
    caller: Caller,
    permit: P,
    lookup: Option<OwnedSemaphorePermit>,
}

impl RideApi {
    pub fn new(app: App, tasks: TaskTracker, penalties: Arc<Penalties>) -> RideApi {
        let limits = app.limits;
        RideApi {
            rides: app.rides,
            internal_api_token: app.internal_api_token,
            tasks,
            limiter: Limiter::new(limits),
            unknown_tokens: DigestCache::new(
                limits.unknown_token_ttl,
                limits.unknown_token_capacity,
            ),
            known_tokens: DigestCache::new(limits.unknown_token_ttl, limits.unknown_token_capacity),
            token_lookups: Arc::new(Semaphore::new(limits.max_concurrent_token_lookups)),
            penalties,
        }
    }

    /// Counts a call refused before the database (credentials, limits) against its peer.
    fn note_refusal<T>(&self, peer: Option<IpAddr>, result: &Result<Response<T>, Status>) {
        let Err(status) = result else { return };
        let refused_early = matches!(
            status.code(),
            tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
                | tonic::Code::ResourceExhausted
        );
        if refused_early && let Some(peer) = peer {
            self.penalties.record_refusal(peer);
        }
    }

    /// A place among the token lookups for a caller whose token was not verified lately; none
    /// needed for a known token or the internal credential.
    fn admit_lookup(&self, caller: Caller) -> Result<Option<OwnedSemaphorePermit>, Status> {
        let Caller::Token(digest) = caller else {
            return Ok(None);
        };
        if self.known_tokens.contains(&digest) {
            return Ok(None);
        }
        Arc::clone(&self.token_lookups)
            .try_acquire_owned()
            .map(Some)
            .map_err(|_| {
                status::rate_limited(
                    "too many calls with tokens not verified lately; retry later",
                    LOOKUP_RETRY,
                )
            })
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
                if self.unknown_tokens.contains(&digest) {
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

    /// Identifies a CreateRide caller and admits it under its limits.
    fn admit_create(&self, metadata: &MetadataMap) -> Result<Admitted<CreatePermit>, Status> {
        let caller = self.identify(metadata)?;
        let permit = self.limiter.admit_create(caller).map_err(|refusal| {
            status::rate_limited(
                "too many CreateRide calls for this user; retry later",
                refusal.retry_after,
            )
        })?;
        let lookup = self.admit_lookup(caller)?;
        Ok(Admitted {
            caller,
            permit,
            lookup,
        })
    }

    /// Identifies a GetRide caller and admits it under its limit. The internal credential is for
    /// CreateRide only: the completer never reads rides.
    fn admit_get(&self, metadata: &MetadataMap) -> Result<Admitted<()>, Status> {
        let token = bearer(metadata);
        if token.as_ref().is_ok_and(|token| self.is_internal(token)) {
            return Err(status::internal_credential_not_allowed());
        }
        let caller = self.caller(token?, metadata)?;
        self.limiter.admit_get(caller).map_err(|refusal| {
            status::rate_limited(
                "too many GetRide calls for this user; retry later",
                refusal.retry_after,
            )
        })?;
        let lookup = self.admit_lookup(caller)?;
        Ok(Admitted {
            caller,
            permit: (),
            lookup,
        })
    }

    /// Whether the caller's `traceparent` may be continued: only an authenticated caller's may
    /// choose the trace id and the sampling decision. The internal credential is authenticated in
    /// memory; a user token needs a lookup unless it was authenticated lately, and only when the
    /// call carries a trace context at all. An unknown token is refused here.
    async fn trusts_trace(
        &self,
        caller: Caller,
        caller_trace: &opentelemetry::Context,
    ) -> Result<bool, Status> {
        if !caller_trace.span().span_context().is_valid() {
            return Ok(false);
        }
        let Caller::Token(digest) = caller else {
            return Ok(true);
        };
        if self.known_tokens.contains(&digest) {
            return Ok(true);
        }
        match auth::user_by_token_digest(self.rides.pool(), &digest).await {
            Ok(Some(_)) => {
                self.known_tokens.insert(digest);
                Ok(true)
            }
            Ok(None) => {
                self.unknown_caller(caller);
                Err(status::invalid_credentials())
            }
            // Not known to be authenticated: a root trace. The call itself then fails or not.
            Err(_) => Ok(false),
        }
    }

    /// Remembers that no user has this caller's token, and forgets its limits.
    fn unknown_caller(&self, caller: Caller) {
        if let Caller::Token(digest) = caller {
            self.known_tokens.remove(&digest);
            self.unknown_tokens.insert(digest);
        }
        self.limiter.forget(caller);
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
                if let Caller::Token(digest) = caller {
                    self.known_tokens.insert(digest);
                }
                Ok(user)
            }
            None => {
                self.unknown_caller(caller);
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
        let (Some(refusal), Ok(key)) = (self.limiter.decline_budget_spent(caller), key) else {
            return Ok(());
        };
        let exists = idempotency::key_exists(self.rides.pool(), caller, key)
            .await
            .map_err(status::store_error)?;
        if exists {
            return Ok(());
        }
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
/// `rpc.server.call.duration`.
async fn traced<T>(
    method: &'static str,
    span: Span,
    handler: impl Future<Output = Result<Response<T>, Status>>,
) -> Result<Response<T>, Status> {
    let started = Instant::now();
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
        let peer = request.remote_addr().map(|addr| addr.ip());
        let admitted = self.admit_create(request.metadata());
        let (span, admitted) = self
            .server_span("CreateRide", request.metadata(), admitted)
            .await;
        let result = traced(
            "CreateRide",
            span,
            self.create_ride_traced(request, admitted),
        )
        .await;
        self.note_refusal(peer, &result);
        result
    }

    async fn get_ride(&self, request: Request<GetRideRequest>) -> Result<Response<Ride>, Status> {
        let peer = request.remote_addr().map(|addr| addr.ip());
        let admitted = self.admit_get(request.metadata());
        let (span, admitted) = self
            .server_span("GetRide", request.metadata(), admitted)
            .await;
        let result = traced("GetRide", span, self.get_ride_traced(request, admitted)).await;
        self.note_refusal(peer, &result);
        result
    }
}

impl RideApi {
    /// The RPC's server span, continuing the caller's trace only if the admitted caller is
    /// authenticated; a token the trust check finds unknown turns the admission into a refusal.
    async fn server_span<P>(
        &self,
        method: &'static str,
        metadata: &MetadataMap,
        admitted: Result<Admitted<P>, Status>,
    ) -> (Span, Result<Admitted<P>, Status>) {
        let caller_trace = telemetry::extract(&MetadataExtractor(metadata));
        let trusted = match &admitted {
            Ok(admitted) => self.trusts_trace(admitted.caller, &caller_trace).await,
            Err(_) => Ok(false),
        };
        let span = rpc_span(method, caller_trace, matches!(trusted, Ok(true)));
        (span, trusted.and(admitted))
    }
}

impl RideApi {
    async fn create_ride_traced(
        &self,
        request: Request<CreateRideRequest>,
        admitted: Result<Admitted<CreatePermit>, Status>,
    ) -> Result<Response<CreateRideResponse>, Status> {
        let fresh = |mut status: Status| {
            status
                .metadata_mut()
                .insert(REPLAYED_HEADER, MetadataValue::from_static("false"));
            status
        };
        let Admitted {
            caller,
            permit,
            lookup,
        } = admitted.map_err(fresh)?;
        let origin_ip = request
            .remote_addr()
            .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |addr| addr.ip());
        let key = idempotency_key(request.metadata());
        self.check_decline_budget(caller, &key)
            .await
            .map_err(fresh)?;
        let (_, _, message) = request.into_parts();
        let params = RideParams::try_from(message);
        // Checked in the contract's order: credentials first, then the key, then the parameters.
        // The credentials of a valid request are checked by the claim's own statement; those of
        // an invalid one need a lookup of their own.
        let valid = match (key, params) {
            (Ok(key), Ok(params)) => Ok((key, params)),
            (Err(invalid_key), _) => Err(invalid_key),
            (Ok(_), Err(violations)) => Err(status::invalid_params(&violations)),
        };
        let (key, params) = match valid {
            Ok(valid) => valid,
            Err(invalid) => {
                let user = self.authenticate(caller).await.map_err(fresh)?;
                Span::current().record("user.id", user.id);
                return Err(fresh(invalid));
            }
        };
        Span::current().record("rides.idempotency_key", key.redacted());
        let rides = Arc::clone(&self.rides);
        // The permits move into the detached attempt: a client that hangs up does not free its
        // place while its attempt still runs.
        let answered = self
            .detached(async move {
                let _permits = (permit, lookup);
                rides.create_ride(caller, &key, params, origin_ip).await
            })
            .await
            .map_err(fresh)?;
        let Some((user_id, reply)) = answered else {
            self.unknown_caller(caller);
            return Err(fresh(status::invalid_credentials()));
        };
        if let Some(user_id) = user_id {
            if let Caller::Token(digest) = caller {
                self.known_tokens.insert(digest);
            }
            Span::current().record("user.id", user_id);
        }
        Span::current().record("rides.replayed", reply.replayed);
        if !reply.replayed && matches!(reply.result, Ok(Outcome::CardDeclined { .. })) {
            self.limiter.record_decline(caller);
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
        // The lookup permit, if any, is held until the answer.
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
