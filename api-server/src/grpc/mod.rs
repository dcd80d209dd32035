//! The gRPC transport: reads metadata (credentials, idempotency key), converts requests into
//! domain values with `TryFrom`, calls `crate::rides`, and maps every domain result to a response
//! or a `Status` in one exhaustive match. Nothing here decides business outcomes.

mod status;

use std::{
    future::Future,
    net::{IpAddr, Ipv4Addr},
    sync::Arc,
    time::Instant,
};

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

use crate::{
    App, auth,
    config::Secret,
    idempotency::IdempotencyKey,
    metrics::metrics,
    rides::{CreateRideReply, FieldViolation, Outcome, RideParams, RideRequest, RideView, Rides},
};

pub use status::{ERROR_DOMAIN, reason};

pub const IDEMPOTENCY_KEY_HEADER: &str = "idempotency-key";
/// With the internal credential only: the id of the user the call is made for.
pub const ON_BEHALF_OF_HEADER: &str = "on-behalf-of-user";
pub const REPLAYED_HEADER: &str = "idempotent-replayed";
pub const EXPIRES_AT_HEADER: &str = "idempotency-key-expires-at";

/// The `rides.v1.RideService` implementation.
pub struct RideApi {
    rides: Arc<Rides>,
    internal_api_token: Option<Secret>,
    /// CreateRide runs in tasks tracked here, so that shutdown can wait for them.
    tasks: TaskTracker,
}

impl RideApi {
    pub fn new(app: App, tasks: TaskTracker) -> RideApi {
        RideApi {
            rides: app.rides,
            internal_api_token: app.internal_api_token,
            tasks,
        }
    }

    /// The digest of the caller's token if the caller presents a plain user token (not the
    /// internal credential, no `on-behalf-of-user`): such a caller can be authenticated by the
    /// claim's own statement. `None` for anything else, which [`RideApi::authenticate`] decides.
    fn user_token_digest(&self, metadata: &MetadataMap) -> Option<[u8; 32]> {
        if metadata.get(ON_BEHALF_OF_HEADER).is_some() {
            return None;
        }
        let token = metadata
            .get("authorization")?
            .to_str()
            .ok()
            .and_then(auth::bearer_token)?;
        let is_internal = self
            .internal_api_token
            .as_ref()
            .is_some_and(|internal| auth::is_internal_token(token, internal.expose()));
        (!is_internal).then(|| auth::token_digest(token))
    }

    /// The caller's user: the owner of a user token, or, for the internal credential, the user
    /// named in `on-behalf-of-user`.
    async fn authenticate(&self, metadata: &MetadataMap) -> Result<User, Status> {
        let header = metadata
            .get("authorization")
            .ok_or_else(status::missing_credentials)?;
        let token = header
            .to_str()
            .ok()
            .and_then(auth::bearer_token)
            .ok_or_else(status::invalid_credentials)?;
        let on_behalf_of = metadata.get(ON_BEHALF_OF_HEADER);
        let is_internal = self
            .internal_api_token
            .as_ref()
            .is_some_and(|internal| auth::is_internal_token(token, internal.expose()));
        let user = match (is_internal, on_behalf_of) {
            (false, None) => auth::authenticate(self.rides.pool(), token).await,
            (false, Some(_)) => return Err(status::on_behalf_of_not_allowed()),
            (true, None) => return Err(status::on_behalf_of_required()),
            (true, Some(user_id)) => {
                let user_id = user_id
                    .to_str()
                    .ok()
                    .and_then(|id| id.parse::<i64>().ok())
                    .ok_or_else(status::on_behalf_of_required)?;
                auth::user_by_id(self.rides.pool(), user_id).await
            }
        };
        user.map_err(status::store_error)?
            .ok_or_else(status::invalid_credentials)
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

impl From<RideView> for Ride {
    fn from(ride: RideView) -> Ride {
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

/// The server span of one RPC, continuing the caller's `traceparent`.
fn rpc_span(method: &'static str, metadata: &MetadataMap) -> Span {
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
    telemetry::continue_trace(&span, &MetadataExtractor(metadata));
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
        let span = rpc_span("CreateRide", request.metadata());
        traced("CreateRide", span, self.create_ride_traced(request)).await
    }

    async fn get_ride(&self, request: Request<GetRideRequest>) -> Result<Response<Ride>, Status> {
        let span = rpc_span("GetRide", request.metadata());
        traced("GetRide", span, self.get_ride_traced(request)).await
    }
}

impl RideApi {
    async fn create_ride_traced(
        &self,
        request: Request<CreateRideRequest>,
    ) -> Result<Response<CreateRideResponse>, Status> {
        let fresh = |mut status: Status| {
            status
                .metadata_mut()
                .insert(REPLAYED_HEADER, MetadataValue::from_static("false"));
            status
        };
        let origin_ip = request
            .remote_addr()
            .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), |addr| addr.ip());
        let key = idempotency_key(request.metadata());
        let user_token = self.user_token_digest(request.metadata());
        let (metadata, _, message) = request.into_parts();
        let params = RideParams::try_from(message);
        let rides = Arc::clone(&self.rides);
        let reply = match (user_token, key, params) {
            // The common case, a user's token with a valid request, authenticates in the claim's
            // own statement.
            (Some(digest), Ok(key), Ok(params)) => {
                let redacted_key = key.redacted();
                let answered = self
                    .detached(async move {
                        rides
                            .authenticate_and_create_ride(&digest, &key, params, origin_ip)
                            .await
                    })
                    .await
                    .map_err(fresh)?;
                let Some((user_id, reply)) = answered else {
                    return Err(fresh(status::invalid_credentials()));
                };
                if let Some(user_id) = user_id {
                    Span::current().record("user.id", user_id);
                }
                Span::current().record("rides.idempotency_key", redacted_key);
                reply
            }
            // Anything else is checked in the contract's order: credentials first, then the key,
            // then the parameters.
            (_, key, params) => {
                let user = self.authenticate(&metadata).await.map_err(fresh)?;
                Span::current().record("user.id", user.id);
                let key = key.map_err(fresh)?;
                Span::current().record("rides.idempotency_key", key.redacted());
                let params =
                    params.map_err(|violations| fresh(status::invalid_params(&violations)))?;
                let ride_request = RideRequest {
                    user,
                    params,
                    origin_ip,
                };
                self.detached(async move { rides.create_ride(&key, &ride_request).await })
                    .await
                    .map_err(fresh)?
            }
        };
        Span::current().record("rides.replayed", reply.replayed);
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
    ) -> Result<Response<Ride>, Status> {
        let user = self.authenticate(request.metadata()).await?;
        let ride_id = request.into_inner().id;
        self.rides
            .get_ride(user.id, ride_id)
            .await
            .map_err(status::store_error)?
            .map(|ride| Response::new(Ride::from(ride)))
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
            ride: Some(Ride::from(ride)),
            message,
        }),
        Ok(Outcome::CardDeclined {
            message,
            decline_code,
        }) => Err(status::card_declined(&message, decline_code.as_deref())),
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
