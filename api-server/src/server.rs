//! Assembles the gRPC server: the ride service, `grpc.health.v1`, and reflection (v1 and
//! v1alpha, so that both current and older grpcurl builds work without proto files).

use std::{future::Future, sync::Arc};

use proto::v1::ride_service_server::RideServiceServer;
use tokio::net::TcpListener;
use tokio_util::task::TaskTracker;
use tonic_health::ServingStatus;

use crate::{
    App,
    admission::peer::TrustedProxies,
    config::TransportConfig,
    grpc::RideApi,
    listener,
    message_cap::CapMessages,
    penalty::{Penalties, PenaltyConfig},
    tls::{TlsError, TlsReloader},
};

/// Largest request accepted. A CreateRideRequest is about 40 bytes; anything near this limit is
/// not a ride.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;
/// HTTP/2 flow-control window of each request stream: the largest request and its gRPC frame
/// header, rounded up to twice the cap.
const STREAM_WINDOW_BYTES: u32 = 2 * MAX_REQUEST_BYTES as u32;
/// Streams a peer may have reset before the server accepted them, at once, before the connection
/// is closed with GOAWAY: the "rapid reset" flood (tonic turns h2's default of 20 off). At least
/// the stream cap: a backend whose calls' deadlines all expire while the server is slow resets
/// every stream it has open, and 20 would close its connection with every rider's call on it.
fn max_pending_accept_reset_streams(max_concurrent_streams: u32) -> usize {
    usize::try_from(max_concurrent_streams)
        .unwrap_or(usize::MAX)
        .max(20)
}
/// Largest metadata (all headers of one call) accepted. A call carries a token, a key of at most
/// 255 characters and a trace context: a few hundred bytes.
pub const MAX_METADATA_BYTES: u32 = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot build the reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("cannot load the TLS certificates")]
    Tls(#[from] TlsError),
    #[error("the gRPC server failed")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves on `listener` (in TLS if the app has certificates) until `shutdown` completes, then
/// drains: health turns NOT_SERVING, no new connections are accepted, in-flight requests finish
/// (each ends by finishing or unlocking its key), and this returns once the last CreateRide task
/// is done.
/// What the server logs when SIGTERM starts its shutdown (health turns `NOT_SERVING`), and when it
/// starts draining in-flight calls: operators read them, and the rolling-deploy campaign
/// (`proof --rolling`) checks each replaced server logged both.
pub const LOG_SHUTTING_DOWN: &str = "shutting down: health is NOT_SERVING";
pub const LOG_DRAINING: &str = "draining in-flight requests";

pub async fn serve(
    listener: TcpListener,
    app: App,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    let readiness = Readiness {
        health: health.clone(),
        ready: Arc::clone(&app.ready),
    };
    // Not ready until `watch_database` finds the database and the liveness session up.
    readiness.set(ServingStatus::NotServing).await;
    // Set once and never changed: see LIVENESS_SERVICE.
    health
        .set_service_status(LIVENESS_SERVICE, ServingStatus::Serving)
        .await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // So grpcurl can decode google.rpc error details (ErrorInfo, BadRequest, RetryInfo).
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;
    // Loaded before anything is served: bad certificates stop the start-up.
    let tls = app.tls.clone().map(TlsReloader::load).transpose()?;
    let tasks = TaskTracker::new();
    let serving = app.serving;
    let monitor = tokio::spawn(watch_database(
        app.rides.pool().clone(),
        app.rides.locking().liveness.clone(),
        readiness.clone(),
        serving.health_check_interval,
    ));
    let transport = app.transport;
    let trusted_proxies = app.trusted_proxies.clone();
    let penalties = Arc::new(Penalties::new(PenaltyConfig {
        refusals: transport.refusals_per_ip,
        cooldown: transport.refusal_cooldown,
    }));
    let rides_service =
        RideServiceServer::new(RideApi::new(app, tasks.clone(), Arc::clone(&penalties)))
            .max_decoding_message_size(MAX_REQUEST_BYTES);
    // Health and reflection answer without a token: the same cap, or anyone could make the
    // server buffer tonic's default of 4 MiB per call. Every service ends an oversized call with
    // OUT_OF_RANGE: tonic does for unary calls, `CapMessages` for reflection's streams.
    let health_service = health_service.max_decoding_message_size(MAX_REQUEST_BYTES);
    let reflection_v1 = CapMessages::new(
        reflection_v1.max_decoding_message_size(MAX_REQUEST_BYTES),
        MAX_REQUEST_BYTES,
    );
    let reflection_v1alpha = CapMessages::new(
        reflection_v1alpha.max_decoding_message_size(MAX_REQUEST_BYTES),
        MAX_REQUEST_BYTES,
    );

    let draining = async move {
        shutdown.await;
        tracing::info!(drain_delay = ?serving.drain_delay, "{LOG_SHUTTING_DOWN}");
        monitor.abort();
        readiness.set(ServingStatus::NotServing).await;
        // Still serving: callers that have not yet seen NOT_SERVING are answered.
        tokio::time::sleep(serving.drain_delay).await;
        tracing::info!("{LOG_DRAINING}");
    };
    let router = server_builder(&transport)
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(rides_service);
    let accepting = Accepting {
        listener,
        transport,
        penalties,
        trusted_proxies,
    };
    serve_until(router, accepting, tls, draining).await?;
    tasks.close();
    tasks.wait().await;
    Ok(())
}

/// The HTTP/2 settings every connection gets from `transport`.
fn server_builder(transport: &TransportConfig) -> tonic::transport::Server {
    tonic::transport::Server::builder()
        .http2_max_header_list_size(MAX_METADATA_BYTES)
        // No request may exceed MAX_REQUEST_BYTES, so a stream never needs more window than
        // this; a peer sending an oversized message gets this much in before its call is
        // refused, not hyper's default 1 MiB.
        .initial_stream_window_size(STREAM_WINDOW_BYTES)
        .max_concurrent_streams(transport.max_concurrent_streams)
        .http2_keepalive_interval(Some(transport.keepalive_interval))
        .http2_keepalive_timeout(Some(transport.keepalive_timeout))
        .http2_max_local_error_reset_streams(Some(transport.max_local_error_reset_streams))
        .http2_max_pending_accept_reset_streams(Some(max_pending_accept_reset_streams(
            transport.max_concurrent_streams,
        )))
        // GOAWAY at the age; the grace is enforced by the listener (`listener::Conn`).
        .max_connection_age(transport.max_connection_age)
        .timeout(transport.request_timeout)
}

/// What the listener needs to accept connections (`listener::incoming`).
struct Accepting {
    listener: TcpListener,
    transport: TransportConfig,
    penalties: Arc<Penalties>,
    trusted_proxies: TrustedProxies,
}

/// Serves `router` on the accepted connections, over TLS when `tls` is set (reloaded by SIGHUP
/// and on file changes), until `draining` ends.
async fn serve_until(
    router: tonic::transport::server::Router,
    accepting: Accepting,
    tls: Option<TlsReloader>,
    draining: impl Future<Output = ()>,
) -> Result<(), ServeError> {
    let Accepting {
        listener,
        transport,
        penalties,
        trusted_proxies,
    } = accepting;
    match tls {
        None => {
            let hangup = ignore_hangup();
            let incoming = listener::incoming(
                listener,
                transport,
                penalties,
                trusted_proxies,
                |tcp| async { Ok(tcp) },
            );
            let served = router
                .serve_with_incoming_shutdown(incoming, draining)
                .await;
            hangup.abort();
            served?;
        }
        Some(tls) => {
            let watcher = tls.spawn_watcher();
            let incoming = listener::incoming(
                listener,
                transport,
                penalties,
                trusted_proxies,
                move |tcp| tokio_rustls::TlsAcceptor::from(tls.current()).accept(tcp),
            );
            let served = router
                .serve_with_incoming_shutdown(incoming, draining)
                .await;
            watcher.abort();
            served?;
        }
    }
    Ok(())
}

/// SIGHUP reloads the TLS certificates; without TLS there is nothing to reload, but the signal's
/// default action would end the process, and an operator's reload habit must not stop a
/// payments server.
fn ignore_hangup() -> tokio::task::JoinHandle<()> {
    tokio::spawn(async {
        #[cfg(unix)]
        if let Ok(mut hangup) =
            tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
        {
            while hangup.recv().await.is_some() {
                tracing::info!("SIGHUP: nothing to reload (the gRPC port has no TLS certificates)");
            }
        }
    })
}

/// The health service name a liveness probe asks for. It answers SERVING for as long as the
/// process answers gRPC at all, whatever the database does: `""` and `rides.v1.RideService` follow
/// the database, and a liveness probe on them would restart every api-server during a database
/// failover, each restart then backing off past the outage's end.
pub const LIVENESS_SERVICE: &str = "liveness";

/// What readiness probes and load balancers read (`""` and the ride service; never the liveness
/// service), and the same for observers in the process ([`crate::App::readiness`]).
#[derive(Clone)]
struct Readiness {
    health: tonic_health::server::HealthReporter,
    ready: Arc<tokio::sync::watch::Sender<bool>>,
}

impl Readiness {
    async fn set(&self, status: ServingStatus) {
        self.health
            .set_service_status("rides.v1.RideService", status)
            .await;
        self.health.set_service_status("", status).await;
        self.ready.send_replace(status == ServingStatus::Serving);
    }
}

/// How long a starting server stays NOT_SERVING waiting for its first liveness session. Its
/// claims wait for that session too, but only `schema::liveness::CONFIRMED_FOR` (2 s): a lock
/// taken after that names no holder, and if the server then dies its key waits out the whole
/// lock timeout (90 s by default). Bounded, so that a liveness URL that never connects delays
/// readiness once, with an error logged, instead of keeping every server out of rotation.
pub const FIRST_SESSION_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Keeps health in step with the database: a server that cannot reach PostgreSQL can answer
/// nothing useful, so it asks to be taken out of rotation. Its first SERVING also waits for the
/// liveness session, up to [`FIRST_SESSION_WAIT`].
async fn watch_database(
    pool: schema::Pool,
    liveness: schema::liveness::Liveness,
    readiness: Readiness,
    interval: std::time::Duration,
) {
    if !liveness.stands_within(FIRST_SESSION_WAIT).await {
        tracing::error!(
            waited = ?FIRST_SESSION_WAIT,
            "the liveness session (DATABASE_LIVENESS_URL) has not opened: health follows the \
             database alone from now; until the session opens, locks name no holder, and if this \
             server dies its keys stay locked for IDEMPOTENCY_LOCK_TIMEOUT_SECS"
        );
    }
    let mut reachable = true;
    loop {
        let check = async {
            let mut conn = pool.get().await.ok()?;
            diesel_async::RunQueryDsl::execute(diesel::sql_query("SELECT 1"), &mut conn)
                .await
                .ok()
        };
        let now_reachable =
            tokio::time::timeout(interval.max(std::time::Duration::from_secs(1)), check)
                .await
                .ok()
                .flatten()
                .is_some();
        if now_reachable != reachable {
            if now_reachable {
                tracing::info!("database reachable again: SERVING");
            } else {
                tracing::error!("database unreachable: NOT_SERVING");
            }
            reachable = now_reachable;
        }
        let status = if now_reachable {
            ServingStatus::Serving
        } else {
            ServingStatus::NotServing
        };
        readiness.set(status).await;
        tokio::time::sleep(interval).await;
    }
}
