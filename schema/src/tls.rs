//! Opening a PostgreSQL connection, with TLS (rustls, ring) when `DATABASE_URL` asks for it. Every
//! connection of the pool, the migrations and the tools goes through [`connect`].
//!
//! diesel-async connects without TLS and tokio-postgres knows only `sslmode=disable|prefer|
//! require`, so the TLS parameters are taken out of the URL here and the connection is made with
//! `tokio_postgres::Config` and a rustls connector. The modes are libpq's:
//!
//! | `sslmode`             | encrypted             | server certificate checked                  |
//! |-----------------------|-----------------------|---------------------------------------------|
//! | absent, `disable`     | no                    | —                                           |
//! | `prefer`              | if the server offers  | no                                          |
//! | `require`             | yes                   | no; with `sslrootcert`, as `verify-ca`      |
//! | `verify-ca`           | yes                   | chain to `sslrootcert`                      |
//! | `verify-full`         | yes                   | chain to `sslrootcert` and the host's name  |
//!
//! Absent is plaintext, not libpq's `prefer`: that is what this service always did (diesel-async
//! connects without TLS), and a deployment that wants TLS says so. `verify-ca` and `verify-full`
//! need `sslrootcert` (a PEM file; libpq's `~/.postgresql/root.crt` fallback is not read). Only
//! the URL form (`postgres://…?sslmode=…`) is understood.

use std::{
    io,
    path::PathBuf,
    pin::Pin,
    str::FromStr,
    sync::Arc,
    task::{Context, Poll},
};

use diesel::{ConnectionError, ConnectionResult};
use diesel_async::{AsyncConnection, AsyncPgConnection, SimpleAsyncConnection};
use futures_util::future::BoxFuture;
use rustls::{
    ClientConfig, DigitallySignedStruct, RootCertStore, SignatureScheme,
    client::{
        WebPkiServerVerifier,
        danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    },
    crypto::{CryptoProvider, ring},
    pki_types::{CertificateDer, ServerName, UnixTime, pem::PemObject},
};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// What `sslmode` asks of the server's certificate, once TLS is on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verify {
    /// Encrypted only (`prefer`, `require` without `sslrootcert`).
    Nothing,
    /// The chain ends at `sslrootcert`; any host name.
    Ca,
    /// The chain ends at `sslrootcert` and names the host connected to.
    Full,
}

/// The TLS part of a `DATABASE_URL`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsParams {
    /// `prefer`: fall back to plaintext if the server has TLS off.
    pub optional: bool,
    pub verify: Verify,
    pub root_cert: Option<PathBuf>,
}

/// Splits `url` into the URL tokio-postgres understands and its TLS parameters (`None`:
/// plaintext).
pub fn parse(url: &str) -> Result<(String, Option<TlsParams>), String> {
    let Some((base, query)) = url.split_once('?') else {
        return Ok((url.to_owned(), None));
    };
    let pairs: Vec<(String, String)> = serde_urlencoded::from_str(query)
        .map_err(|error| format!("DATABASE_URL's query is not valid: {error}"))?;
    let mut mode = None;
    let mut root_cert = None;
    let mut rest = Vec::new();
    for (name, value) in pairs {
        match name.as_str() {
            "sslmode" => mode = Some(value),
            "sslrootcert" => root_cert = Some(PathBuf::from(value)),
            _ => rest.push((name, value)),
        }
    }
    let (optional, verify) = match mode.as_deref() {
        None | Some("disable") => return Ok((url.to_owned(), None)),
        Some("prefer") => (true, Verify::Nothing),
        Some("require") if root_cert.is_some() => (false, Verify::Ca),
        Some("require") => (false, Verify::Nothing),
        Some("verify-ca") => (false, Verify::Ca),
        Some("verify-full") => (false, Verify::Full),
        Some(other) => {
            return Err(format!(
                "sslmode={other} is not supported (disable, prefer, require, verify-ca, verify-full)"
            ));
        }
    };
    if verify != Verify::Nothing && root_cert.is_none() {
        return Err("sslmode=verify-ca and verify-full need sslrootcert (a PEM file)".into());
    }
    let rest = serde_urlencoded::to_string(&rest).map_err(|error| error.to_string())?;
    let base = if rest.is_empty() {
        base.to_owned()
    } else {
        format!("{base}?{rest}")
    };
    Ok((
        base,
        Some(TlsParams {
            optional,
            verify,
            root_cert,
        }),
    ))
}

/// Opens one connection to `url`, with TLS as its `sslmode` asks, saying what this version
/// of the processes knows ([`SESSION_DECLARATIONS`]).
pub async fn connect(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let mut conn = open(url).await?;
    conn.batch_execute(SESSION_DECLARATIONS)
        .await
        .map_err(|error| bad("cannot set up the session", error))?;
    Ok(conn)
}

/// What every connection of this version declares: it knows deployment ids, so the migration
/// `2026-11-26-100000_fence_older_servers` lets it take the lock of a key whose ride carries one
/// (a server from before deployment ids would charge that ride under another provider key); and
/// it names the holder of every lock it takes, so the migration `2026-11-28-100000_lock_holders`
/// keeps the holder it writes (a server from before holder ids has the holder forgotten).
pub const SESSION_DECLARATIONS: &str =
    "SET rocket_rides.provider_keys = 'deployment'; SET rocket_rides.lock_holders = 'named'";

async fn open(url: &str) -> ConnectionResult<AsyncPgConnection> {
    let (url, tls) = parse(url).map_err(ConnectionError::BadConnection)?;
    let Some(tls) = tls else {
        return AsyncPgConnection::establish(&url).await;
    };
    let mut config =
        tokio_postgres::Config::from_str(&url).map_err(|error| bad("DATABASE_URL", error))?;
    config.ssl_mode(if tls.optional {
        tokio_postgres::config::SslMode::Prefer
    } else {
        tokio_postgres::config::SslMode::Require
    });
    let connector = RustlsConnect(Arc::new(client_config(&tls)?));
    let (client, connection) = config
        .connect(connector)
        .await
        // tokio-postgres's own message is only "error performing TLS handshake"; the cause (an
        // unknown issuer, a name mismatch) is what an operator needs.
        .map_err(|error| bad("cannot connect", telemetry::error_chain(&error)))?;
    AsyncPgConnection::try_from_client_and_connection(client, connection).await
}

/// The boxed form [`diesel_async::pooled_connection::ManagerConfig::custom_setup`] takes.
pub(crate) fn connect_boxed(url: &str) -> BoxFuture<'_, ConnectionResult<AsyncPgConnection>> {
    // Connected on the I/O thread, so that the connection's task is spawned there.
    let url = url.to_owned();
    Box::pin(async move {
        crate::io_thread::spawn(async move { connect(&url).await })
            .await
            .map_err(|error| ConnectionError::BadConnection(error.to_string()))?
    })
}

/// Replaces the database name in a `postgres://…/name?options` URL, keeping every host of a
/// multi-host URL and its options (`target_session_attrs`, `sslmode`).
pub fn database_url(server_url: &str, database: &str) -> String {
    let (base, query) = match server_url.split_once('?') {
        Some((base, query)) => (base, Some(query)),
        None => (server_url, None),
    };
    let authority_end = base
        .find("://")
        .map(|scheme| scheme + 3)
        .and_then(|start| base[start..].find('/').map(|slash| start + slash))
        .unwrap_or(base.len());
    let mut url = format!("{}/{}", &base[..authority_end], database);
    if let Some(query) = query {
        url.push('?');
        url.push_str(query);
    }
    url
}

fn bad(context: &str, error: impl std::fmt::Display) -> ConnectionError {
    ConnectionError::BadConnection(format!("{context}: {error}"))
}

fn client_config(tls: &TlsParams) -> ConnectionResult<ClientConfig> {
    let provider = Arc::new(ring::default_provider());
    let verifier: Arc<dyn ServerCertVerifier> = match (&tls.root_cert, tls.verify) {
        (Some(path), Verify::Ca | Verify::Full) => {
            let unusable = |error: &dyn std::fmt::Display| {
                bad(&format!("sslrootcert {}", path.display()), error)
            };
            let mut roots = RootCertStore::empty();
            for cert in CertificateDer::pem_file_iter(path).map_err(|e| unusable(&e))? {
                roots
                    .add(cert.map_err(|e| unusable(&e))?)
                    .map_err(|e| unusable(&e))?;
            }
            let webpki =
                WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                    .build()
                    .map_err(|error| bad("sslrootcert", error))?;
            Arc::new(Checked {
                webpki,
                any_name: tls.verify == Verify::Ca,
            })
        }
        _ => Arc::new(Unchecked(provider.clone())),
    };
    Ok(ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|error| bad("TLS", error))?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_no_client_auth())
}

/// `verify-ca` and `verify-full`: webpki's verification, minus the name check for `verify-ca`.
#[derive(Debug)]
struct Checked {
    webpki: Arc<WebPkiServerVerifier>,
    any_name: bool,
}

impl ServerCertVerifier for Checked {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        match self.webpki.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            Err(rustls::Error::InvalidCertificate(
                rustls::CertificateError::NotValidForName
                | rustls::CertificateError::NotValidForNameContext { .. },
            )) if self.any_name => Ok(ServerCertVerified::assertion()),
            result => result,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.webpki.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.webpki.supported_verify_schemes()
    }
}

/// `prefer` and `require`: any certificate, as libpq does; the handshake's signatures are
/// still checked, so the session is encrypted to whoever holds that certificate's key.
#[derive(Debug)]
struct Unchecked(Arc<CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(
            message,
            cert,
            dss,
            &self.0.signature_verification_algorithms,
        )
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// tokio-postgres's TLS hooks over tokio-rustls.
#[derive(Clone)]
struct RustlsConnect(Arc<ClientConfig>);

struct RustlsHandshake {
    config: Arc<ClientConfig>,
    name: ServerName<'static>,
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsHandshake;
    type Error = io::Error;

    fn make_tls_connect(&mut self, domain: &str) -> io::Result<RustlsHandshake> {
        let name = ServerName::try_from(domain.to_owned())
            .map_err(|error| io::Error::new(io::ErrorKind::InvalidInput, error))?;
        Ok(RustlsHandshake {
            config: Arc::clone(&self.0),
            name,
        })
    }
}

impl<S> TlsConnect<S> for RustlsHandshake
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = BoxFuture<'static, io::Result<RustlsStream<S>>>;

    fn connect(self, stream: S) -> Self::Future {
        let connector = tokio_rustls::TlsConnector::from(self.config);
        Box::pin(async move {
            let stream = connector.connect(self.name, stream).await?;
            Ok(RustlsStream(Box::new(stream)))
        })
    }
}

/// A rustls session as tokio-postgres's `TlsStream`. No channel binding: SCRAM then falls
/// back to plain SCRAM-SHA-256 (tokio-postgres's `channel_binding=prefer`).
pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S> tokio_postgres::tls::TlsStream for RustlsStream<S>
where
    S: AsyncRead + AsyncWrite + Unpin,
{
    fn channel_binding(&self) -> ChannelBinding {
        ChannelBinding::none()
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn replaces_the_database_name() {
        use super::database_url;
        assert_eq!(
            database_url("postgres://postgres@127.0.0.1:5432/postgres", "x"),
            "postgres://postgres@127.0.0.1:5432/x"
        );
        assert_eq!(
            database_url("postgres://u:p@h/db?sslmode=disable", "y"),
            "postgres://u:p@h/y?sslmode=disable"
        );
        assert_eq!(database_url("postgres://h:1", "z"), "postgres://h:1/z");
        assert_eq!(
            database_url(
                "postgres://u:p@h1:5432,h2:5433/postgres?target_session_attrs=read-write",
                "proof"
            ),
            "postgres://u:p@h1:5432,h2:5433/proof?target_session_attrs=read-write"
        );
    }

    use super::*;

    #[test]
    fn parses_sslmode() {
        let url = "postgres://u:p@db:5432/rides";
        assert_eq!(parse(url).unwrap(), (url.to_owned(), None));
        let (base, tls) = parse(&format!("{url}?sslmode=disable")).unwrap();
        assert_eq!(
            (base.as_str(), tls),
            (&*format!("{url}?sslmode=disable"), None)
        );

        let (base, tls) = parse(&format!("{url}?application_name=w&sslmode=require")).unwrap();
        assert_eq!(base, format!("{url}?application_name=w"));
        let tls = tls.unwrap();
        assert_eq!((tls.optional, tls.verify), (false, Verify::Nothing));

        let (_, tls) = parse(&format!("{url}?sslmode=prefer")).unwrap();
        assert!(tls.unwrap().optional);

        let (base, tls) = parse(&format!(
            "{url}?sslmode=verify-full&sslrootcert=%2Fetc%2Fca%20dir%2Froot.pem"
        ))
        .unwrap();
        assert_eq!(base, url);
        let tls = tls.unwrap();
        assert_eq!(tls.verify, Verify::Full);
        assert_eq!(tls.root_cert, Some(PathBuf::from("/etc/ca dir/root.pem")));

        let (_, tls) = parse(&format!("{url}?sslmode=require&sslrootcert=/ca.pem")).unwrap();
        assert_eq!(
            tls.unwrap().verify,
            Verify::Ca,
            "libpq: a root cert makes require verify"
        );
    }

    #[test]
    fn rejects_what_it_cannot_honour() {
        let url = "postgres://db/rides";
        assert!(parse(&format!("{url}?sslmode=verify-full")).is_err());
        assert!(parse(&format!("{url}?sslmode=verify-ca")).is_err());
        assert!(parse(&format!("{url}?sslmode=allow")).is_err());
        assert!(parse(&format!("{url}?sslmode=requre")).is_err());
    }
}
