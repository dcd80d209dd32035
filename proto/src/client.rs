//! Connecting a client to the api-server: the one place that turns `API_SERVER_URL` and the
//! optional TLS files into a tonic [`Endpoint`], for the completer, the load generator, the proof
//! harness and tests alike.
//!
//! `http://` is plaintext and takes no TLS files (a CA or a client certificate with a plaintext
//! URL is refused rather than silently ignored, as tonic would). `https://` is TLS: the server is
//! verified against [`ClientTls::ca`] when given, otherwise against the public web PKI
//! (webpki-roots); a client certificate and key, given together, are presented for mutual TLS.

use std::{
    io,
    path::{Path, PathBuf},
};

use tonic::transport::{Certificate, ClientTlsConfig, Endpoint, Identity};

/// PEM files for a TLS connection to the api-server. All `None`: plaintext, or TLS against the
/// public roots for an `https://` URL.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientTls {
    /// CA certificate(s) that signed the server's certificate (`API_SERVER_CA`).
    pub ca: Option<PathBuf>,
    /// This client's certificate chain, for mutual TLS (`API_SERVER_CLIENT_CERT`).
    pub cert: Option<PathBuf>,
    /// The private key of [`ClientTls::cert`] (`API_SERVER_CLIENT_KEY`).
    pub key: Option<PathBuf>,
}

impl ClientTls {
    fn is_empty(&self) -> bool {
        self.ca.is_none() && self.cert.is_none() && self.key.is_none()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum EndpointError {
    #[error("the api-server URL {url:?} is not valid")]
    Url {
        url: String,
        #[source]
        source: tonic::transport::Error,
    },
    #[error("the api-server URL must start with http:// or https://, not {url:?}")]
    Scheme { url: String },
    #[error("TLS files are set but the api-server URL {url:?} is plaintext; use https://")]
    TlsWithPlaintext { url: String },
    #[error("a client certificate needs its key and a key its certificate (set both or neither)")]
    HalfIdentity,
    #[error("cannot read {path}")]
    Read {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the TLS settings are not usable")]
    Tls(#[source] tonic::transport::Error),
}

/// An endpoint for `url`, with TLS when the URL is `https://`. Callers add their own timeouts and
/// then connect (eagerly or lazily).
pub fn endpoint(url: &str, tls: &ClientTls) -> Result<Endpoint, EndpointError> {
    let endpoint = Endpoint::from_shared(url.to_owned()).map_err(|source| EndpointError::Url {
        url: url.to_owned(),
        source,
    })?;
    match endpoint.uri().scheme_str() {
        Some("http") if tls.is_empty() => Ok(endpoint),
        Some("http") => Err(EndpointError::TlsWithPlaintext {
            url: url.to_owned(),
        }),
        Some("https") => endpoint
            .tls_config(client_tls_config(tls)?)
            .map_err(EndpointError::Tls),
        _ => Err(EndpointError::Scheme {
            url: url.to_owned(),
        }),
    }
}

fn client_tls_config(tls: &ClientTls) -> Result<ClientTlsConfig, EndpointError> {
    let config = match &tls.ca {
        Some(ca) => ClientTlsConfig::new().ca_certificate(Certificate::from_pem(read(ca)?)),
        None => ClientTlsConfig::new().with_webpki_roots(),
    };
    match (&tls.cert, &tls.key) {
        (None, None) => Ok(config),
        (Some(cert), Some(key)) => Ok(config.identity(Identity::from_pem(read(cert)?, read(key)?))),
        _ => Err(EndpointError::HalfIdentity),
    }
}

fn read(path: &Path) -> Result<Vec<u8>, EndpointError> {
    std::fs::read(path).map_err(|source| EndpointError::Read {
        path: path.to_owned(),
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plaintext_takes_no_tls_files() {
        assert!(endpoint("http://127.0.0.1:50051", &ClientTls::default()).is_ok());
        let ca = ClientTls {
            ca: Some("/nonexistent/ca.pem".into()),
            ..ClientTls::default()
        };
        assert!(matches!(
            endpoint("http://127.0.0.1:50051", &ca),
            Err(EndpointError::TlsWithPlaintext { .. })
        ));
    }

    #[test]
    fn rejects_bad_settings() {
        assert!(matches!(
            endpoint("ftp://127.0.0.1:50051", &ClientTls::default()),
            Err(EndpointError::Scheme { .. })
        ));
        assert!(matches!(
            endpoint("not a url", &ClientTls::default()),
            Err(EndpointError::Url { .. })
        ));
        let half = ClientTls {
            cert: Some("/nonexistent/client.pem".into()),
            ..ClientTls::default()
        };
        assert!(matches!(
            endpoint("https://localhost:50051", &half),
            Err(EndpointError::HalfIdentity)
        ));
        let missing = ClientTls {
            ca: Some("/nonexistent/ca.pem".into()),
            ..ClientTls::default()
        };
        assert!(matches!(
            endpoint("https://localhost:50051", &missing),
            Err(EndpointError::Read { .. })
        ));
    }

    #[test]
    fn https_without_a_ca_uses_the_public_roots() {
        assert!(endpoint("https://localhost:50051", &ClientTls::default()).is_ok());
    }
}
