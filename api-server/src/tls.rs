//! TLS for the gRPC listener (rustls, ring provider): the server's certificate and key, and with
//! a client CA, mutual TLS. The PEM files are re-read on SIGHUP and whenever their modification
//! times or sizes change; each new connection takes the configuration current when it is
//! accepted, so a reload never touches open connections, and a reload that fails (a half-written
//! or bad file) keeps the previous configuration and logs why.

use std::{
    fs,
    path::{Path, PathBuf},
    sync::{Arc, PoisonError, RwLock},
    time::SystemTime,
};

use rustls::{
    RootCertStore, ServerConfig,
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
    server::WebPkiClientVerifier,
};
use telemetry::attr;

use crate::{config::TlsConfig, metrics::metrics};

#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("cannot read {path}")]
    Pem {
        path: PathBuf,
        #[source]
        source: rustls::pki_types::pem::Error,
    },
    #[error("{path} holds no certificate")]
    NoCertificate { path: PathBuf },
    #[error("invalid TLS configuration")]
    Rustls(#[from] rustls::Error),
    #[error("invalid client CA")]
    ClientCa(#[from] rustls::server::VerifierBuilderError),
}

/// The listener's current TLS configuration, replaced whole on reload.
#[derive(Clone)]
pub struct TlsReloader {
    files: TlsConfig,
    current: Arc<RwLock<Arc<ServerConfig>>>,
}

impl TlsReloader {
    /// Loads the files once; a server whose certificates cannot be read does not start.
    pub fn load(files: TlsConfig) -> Result<TlsReloader, TlsError> {
        let config = server_config(&files)?;
        Ok(TlsReloader {
            files,
            current: Arc::new(RwLock::new(config)),
        })
    }

    /// The configuration a connection accepted now uses.
    pub fn current(&self) -> Arc<ServerConfig> {
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Re-reads the files; on failure the previous configuration stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let result = server_config(&self.files).map(|config| {
            *self.current.write().unwrap_or_else(PoisonError::into_inner) = config;
        });
        let outcome = if result.is_ok() { "reloaded" } else { "failed" };
        metrics().tls_reloads.add(1, &[attr("outcome", outcome)]);
        result
    }

    /// Reloads on SIGHUP and when the files change, until the returned task is aborted.
    pub fn spawn_watcher(&self) -> tokio::task::JoinHandle<()> {
        let reloader = self.clone();
        tokio::spawn(async move {
            #[cfg(unix)]
            let mut hangup =
                tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup()).ok();
            let mut seen = reloader.stamps();
            let mut poll = tokio::time::interval(reloader.files.reload_interval);
            loop {
                #[cfg(unix)]
                let signalled = async {
                    match hangup.as_mut() {
                        Some(hangup) => hangup.recv().await,
                        None => std::future::pending().await,
                    }
                };
                #[cfg(not(unix))]
                let signalled = std::future::pending::<Option<()>>();
                let cause = tokio::select! {
                    _ = signalled => "SIGHUP",
                    _ = poll.tick() => {
                        let now = reloader.stamps();
                        if now == seen {
                            continue;
                        }
                        seen = now;
                        "files changed"
                    }
                };
                match reloader.reload() {
                    Ok(()) => tracing::info!(cause, "TLS certificates reloaded"),
                    Err(error) => tracing::error!(
                        cause,
                        error = %telemetry::error_chain(&error),
                        "TLS certificates not reloaded; keeping the previous ones"
                    ),
                }
            }
        })
    }

    /// Modification time and size of each file, to notice a change without reading them.
    fn stamps(&self) -> Vec<Option<(SystemTime, u64)>> {
        let files = &self.files;
        [
            Some(&files.cert_path),
            Some(&files.key_path),
            files.client_ca_path.as_ref(),
        ]
        .into_iter()
        .flatten()
        .map(|path| {
            let meta = fs::metadata(path).ok()?;
            Some((meta.modified().ok()?, meta.len()))
        })
        .collect()
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(ring::default_provider())
}

fn server_config(files: &TlsConfig) -> Result<Arc<ServerConfig>, TlsError> {
    let chain = certificates(&files.cert_path)?;
    let key = PrivateKeyDer::from_pem_file(&files.key_path).map_err(|source| TlsError::Pem {
        path: files.key_path.clone(),
        source,
    })?;
    let builder =
        ServerConfig::builder_with_provider(provider()).with_safe_default_protocol_versions()?;
    let builder = match &files.client_ca_path {
        Some(ca_path) => {
            let mut roots = RootCertStore::empty();
            for ca in certificates(ca_path)? {
                roots.add(ca)?;
            }
            let verifier =
                WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider()).build()?;
            builder.with_client_cert_verifier(verifier)
        }
        None => builder.with_no_client_auth(),
    };
    let mut config = builder.with_single_cert(chain, key)?;
    // gRPC is HTTP/2 only.
    config.alpn_protocols = vec![b"h2".to_vec()];
    Ok(Arc::new(config))
}

fn certificates(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let pem_error = |source| TlsError::Pem {
        path: path.to_owned(),
        source,
    };
    let chain = CertificateDer::pem_file_iter(path)
        .map_err(pem_error)?
        .collect::<Result<Vec<_>, _>>()
        .map_err(pem_error)?;
    if chain.is_empty() {
        return Err(TlsError::NoCertificate {
            path: path.to_owned(),
        });
    }
    Ok(chain)
}
