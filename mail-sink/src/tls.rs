//! TLS for the sink, as a relay offers it: STARTTLS on the plain listener (submission, port 587)
//! and a listener that speaks TLS from the first byte (`smtps`, port 465). Certificates are PEM
//! files (the deployment's) or PEM text (the tests' throwaway CA); rustls on ring, as everywhere.

use std::{io, path::Path, sync::Arc};

use rustls::{
    ServerConfig,
    crypto::ring,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
};
use tokio_rustls::TlsAcceptor;

/// The sink's server certificate and key.
#[derive(Clone)]
pub struct SinkTls {
    acceptor: TlsAcceptor,
}

impl SinkTls {
    /// From a certificate chain and a private key in PEM files.
    pub fn from_pem_files(cert: &Path, key: &Path) -> io::Result<SinkTls> {
        SinkTls::from_pem(&std::fs::read(cert)?, &std::fs::read(key)?)
    }

    /// From a certificate chain and a private key in PEM.
    pub fn from_pem(cert: &[u8], key: &[u8]) -> io::Result<SinkTls> {
        let chain = CertificateDer::pem_slice_iter(cert)
            .collect::<Result<Vec<_>, _>>()
            .map_err(invalid)?;
        if chain.is_empty() {
            return Err(invalid("no certificate in the PEM"));
        }
        let key = PrivateKeyDer::from_pem_slice(key).map_err(invalid)?;
        let config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(invalid)?
            .with_no_client_auth()
            .with_single_cert(chain, key)
            .map_err(invalid)?;
        Ok(SinkTls {
            acceptor: TlsAcceptor::from(Arc::new(config)),
        })
    }

    pub(crate) fn acceptor(&self) -> &TlsAcceptor {
        &self.acceptor
    }
}

fn invalid(error: impl std::fmt::Display) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidInput, error.to_string())
}
