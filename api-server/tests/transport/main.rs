//! The gRPC listener against real clients on loopback: TLS and mutual TLS with certificate
//! reloads, and the transport limits (HTTP/2 stream cap, message caps on every service, the
//! preface deadline, the idle timeout, the per-IP connection cap). The server and the health
//! checks both modules use live here.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod limits;
mod tls;

use api_server::testing::*;
use tonic::transport::Channel;
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

async fn spawn(overrides: &[(&str, String)]) -> TestApp {
    let overrides: Vec<(&str, &str)> = overrides
        .iter()
        .map(|(name, value)| (*name, value.as_str()))
        .collect();
    TestApp::spawn_with(fake_stripe::Config::default(), &overrides).await
}

async fn check(channel: Channel) -> Result<ServingStatus, tonic::Status> {
    let answer = HealthClient::new(channel)
        .check(HealthCheckRequest::default())
        .await?;
    Ok(answer.into_inner().status())
}
