//! Assembles the gRPC server: the ride service, `grpc.health.v1`, and reflection (v1 and
//! v1alpha, so that both current and older grpcurl builds work without proto files).

use std::future::Future;

use proto::v1::ride_service_server::RideServiceServer;
use tokio::net::TcpListener;
use tokio_stream::wrappers::TcpListenerStream;
use tokio_util::task::TaskTracker;
use tonic_health::ServingStatus;

use crate::{App, grpc::RideApi};

/// Largest request accepted. A CreateRideRequest is about 40 bytes; anything near this limit is
/// not a ride.
pub const MAX_REQUEST_BYTES: usize = 16 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    #[error("cannot build the reflection service")]
    Reflection(#[from] tonic_reflection::server::Error),
    #[error("the gRPC server failed")]
    Transport(#[from] tonic::transport::Error),
}

/// Serves on `listener` until `shutdown` completes, then drains: health turns NOT_SERVING, no
/// new connections are accepted, in-flight requests finish (each ends by finishing or unlocking
/// its key), and this returns once the last CreateRide task is done.
pub async fn serve(
    listener: TcpListener,
    app: App,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> Result<(), ServeError> {
    let (health, health_service) = tonic_health::server::health_reporter();
    health.set_serving::<RideServiceServer<RideApi>>().await;
    let reflection = || {
        tonic_reflection::server::Builder::configure()
            .register_encoded_file_descriptor_set(proto::FILE_DESCRIPTOR_SET)
            .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
            // So grpcurl can decode google.rpc error details (ErrorInfo, BadRequest, RetryInfo).
            .register_encoded_file_descriptor_set(tonic_types::pb::FILE_DESCRIPTOR_SET)
    };
    let reflection_v1 = reflection().build_v1()?;
    let reflection_v1alpha = reflection().build_v1alpha()?;
    let tasks = TaskTracker::new();
    let rides_service = RideServiceServer::new(RideApi::new(app, tasks.clone()))
        .max_decoding_message_size(MAX_REQUEST_BYTES);

    let draining = async move {
        shutdown.await;
        tracing::info!("shutting down: draining in-flight requests");
        health.set_not_serving::<RideServiceServer<RideApi>>().await;
        health
            .set_service_status("", ServingStatus::NotServing)
            .await;
    };
    tonic::transport::Server::builder()
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(rides_service)
        .serve_with_incoming_shutdown(TcpListenerStream::new(listener), draining)
        .await?;
    tasks.close();
    tasks.wait().await;
    Ok(())
}
