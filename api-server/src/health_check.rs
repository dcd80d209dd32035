//! `api-server health-check`: the container's own probe of its `grpc.health.v1` service.
//!
//! Kubernetes' native gRPC probe cannot speak TLS, so with `GRPC_TLS_*` set the kubelet runs this
//! instead (an exec probe). It dials the listener of the same configuration over loopback, over
//! TLS when the listener speaks it (verifying the server against `--ca`, by default the client CA,
//! which in the deployments is the one CA that issued every certificate), presenting the
//! server's own certificate when the listener requires client certificates, and succeeds only on
//! `SERVING`.

use std::{
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::{Path, PathBuf},
    time::Duration,
};

use proto::client::{ClientTls, EndpointError, endpoint};
use tonic_health::pb::{
    HealthCheckRequest, health_check_response::ServingStatus, health_client::HealthClient,
};

use crate::config::Config;

/// Well inside the deployments' probe timeouts (2 s and more).
pub const CHECK_TIMEOUT: Duration = Duration::from_secs(1);

#[derive(Debug, thiserror::Error)]
pub enum HealthCheckError {
    #[error(
        "the listener speaks TLS and there is no CA to verify it against: pass --ca or set \
         GRPC_TLS_CLIENT_CA"
    )]
    NoCa,
    #[error("cannot build the probe's client")]
    Endpoint(#[from] EndpointError),
    #[error("cannot reach the api-server at {url}")]
    Unreachable {
        url: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the health check failed: {0}")]
    Failed(tonic::Status),
    #[error("{service} is {status:?}")]
    NotServing {
        service: String,
        status: ServingStatus,
    },
    #[error("no answer within {0:?}")]
    TimedOut(Duration),
}

/// Where and how the probe dials: the listener's port on loopback, and the TLS files to use.
pub fn probe_target(
    config: &Config,
    ca: Option<&Path>,
) -> Result<(String, ClientTls), HealthCheckError> {
    let addr = loopback_of(config.grpc_listen_addr);
    let Some(tls) = &config.tls else {
        return Ok((format!("http://{addr}"), ClientTls::default()));
    };
    let ca: PathBuf = ca
        .map(Path::to_path_buf)
        .or_else(|| tls.client_ca_path.clone())
        .ok_or(HealthCheckError::NoCa)?;
    // Only a listener that demands client certificates is shown one: its own.
    let identity = tls.client_ca_path.is_some();
    let client = ClientTls {
        ca: Some(ca),
        cert: identity.then(|| tls.cert_path.clone()),
        key: identity.then(|| tls.key_path.clone()),
    };
    Ok((format!("https://{addr}"), client))
}

/// An unspecified listen address (0.0.0.0, ::) is reached on loopback; a specific one as is.
fn loopback_of(listen: SocketAddr) -> SocketAddr {
    let ip = match listen.ip() {
        IpAddr::V4(ip) if ip.is_unspecified() => IpAddr::V4(Ipv4Addr::LOCALHOST),
        IpAddr::V6(ip) if ip.is_unspecified() => IpAddr::V6(Ipv6Addr::LOCALHOST),
        ip => ip,
    };
    SocketAddr::new(ip, listen.port())
}

/// Asks the api-server of `config` whether `service` is serving ("" is the whole server).
pub async fn check(
    config: &Config,
    service: &str,
    ca: Option<&Path>,
) -> Result<(), HealthCheckError> {
    let (url, tls) = probe_target(config, ca)?;
    let endpoint = endpoint(&url, &tls)?
        .connect_timeout(CHECK_TIMEOUT)
        .timeout(CHECK_TIMEOUT);
    let ask = async {
        let channel = endpoint
            .connect()
            .await
            .map_err(|source| HealthCheckError::Unreachable {
                url: url.clone(),
                source,
            })?;
        let response = HealthClient::new(channel)
            .check(HealthCheckRequest {
                service: service.to_owned(),
            })
            .await
            .map_err(HealthCheckError::Failed)?;
        match response.into_inner().status() {
            ServingStatus::Serving => Ok(()),
            status => Err(HealthCheckError::NotServing {
                service: service.to_owned(),
                status,
            }),
        }
    };
    tokio::time::timeout(CHECK_TIMEOUT * 2, ask)
        .await
        .map_err(|_| HealthCheckError::TimedOut(CHECK_TIMEOUT * 2))?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_unspecified_listener_is_probed_on_loopback() {
        let probed = |listen: &str| loopback_of(listen.parse().unwrap()).to_string();
        assert_eq!(probed("0.0.0.0:50051"), "127.0.0.1:50051");
        assert_eq!(probed("[::]:50051"), "[::1]:50051");
        assert_eq!(probed("10.1.2.3:7000"), "10.1.2.3:7000");
    }

    #[test]
    fn a_tls_listener_is_probed_over_tls_with_its_own_certificate_when_mutual() {
        let config = |vars: &[(&str, &str)]| {
            let vars: Vec<(String, String)> = vars
                .iter()
                .chain(&[("GRPC_LISTEN_ADDR", "0.0.0.0:50051")])
                .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
                .collect();
            Config::from_lookup(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
                .unwrap()
        };
        let plain = config(&[]);
        let (url, tls) = probe_target(&plain, None).unwrap();
        assert_eq!(url, "http://127.0.0.1:50051");
        assert!(tls.ca.is_none() && tls.cert.is_none());

        let server_only = config(&[
            ("GRPC_TLS_CERT", "/t/tls.crt"),
            ("GRPC_TLS_KEY", "/t/tls.key"),
        ]);
        assert!(matches!(
            probe_target(&server_only, None),
            Err(HealthCheckError::NoCa)
        ));
        let (url, tls) = probe_target(&server_only, Some(Path::new("/t/ca.crt"))).unwrap();
        assert_eq!(url, "https://127.0.0.1:50051");
        assert_eq!(tls.ca.as_deref(), Some(Path::new("/t/ca.crt")));
        assert!(
            tls.cert.is_none(),
            "no certificate shown to a server that asks none"
        );

        let mutual = config(&[
            ("GRPC_TLS_CERT", "/t/tls.crt"),
            ("GRPC_TLS_KEY", "/t/tls.key"),
            ("GRPC_TLS_CLIENT_CA", "/t/ca.crt"),
        ]);
        let (_, tls) = probe_target(&mutual, None).unwrap();
        assert_eq!(tls.ca.as_deref(), Some(Path::new("/t/ca.crt")));
        assert_eq!(tls.cert.as_deref(), Some(Path::new("/t/tls.crt")));
        assert_eq!(tls.key.as_deref(), Some(Path::new("/t/tls.key")));
    }
}
