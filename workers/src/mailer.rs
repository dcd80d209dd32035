//! Receipt e-mails over SMTP with lettre (rustls on ring for TLS). `SMTP_URL` follows lettre's
//! URL convention, plus RabbitMQ's `cacertfile` for a relay with a private CA:
//!
//! - `smtp://host[:port]` (port 25): plaintext, for a local MTA or the development mail sink.
//! - `smtp://[user:password@]host[:port]?tls=required` (port 587): STARTTLS, and the connection
//!   fails if the relay does not offer it.
//! - `smtps://[user:password@]host[:port]` (port 465): TLS from the first byte.
//! - `?tls=opportunistic`: STARTTLS if offered, plaintext otherwise (an active attacker can strip
//!   it, so it takes no credentials).
//! - `&cacertfile=/path/ca.pem`: trust that CA besides the public web PKI.
//!
//! Credentials (percent-encoded in the URL) are only accepted with TLS required, so a password
//! never crosses the network in the clear; they are never logged (the URL is a `Secret`).

use std::{path::PathBuf, sync::Arc, time::Duration};

use chrono::{DateTime, Utc};
use lettre::{
    AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor,
    message::{Mailbox, header::ContentType},
    transport::smtp::{
        PoolConfig,
        authentication::Credentials,
        client::{Certificate, Tls, TlsParameters},
    },
};

/// Domain of the deterministic Message-IDs.
pub const MESSAGE_ID_DOMAIN: &str = "rocketrides.test";

/// The same ride always yields the same Message-ID, so a mail system that sees a residual
/// duplicate (see `docs/workers.md`, "the crash window") can drop it.
pub fn receipt_message_id(ride_id: i64) -> String {
    format!("<ride-{ride_id}.receipt@{MESSAGE_ID_DOMAIN}>")
}

#[derive(Debug, thiserror::Error)]
pub enum MailerConfigError {
    #[error("SMTP_URL is not valid: {0}")]
    Url(&'static str),
    #[error("SMTP_URL's cacertfile {path} cannot be read")]
    CaFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("SMTP_URL's TLS settings are not usable")]
    Tls(#[source] lettre::transport::smtp::Error),
    #[error("RECEIPT_FROM is not a valid mailbox")]
    From,
}

#[derive(Debug, thiserror::Error)]
pub enum MailError {
    /// Worth retrying later, and the relay did not take the message: 4xx replies, connection
    /// failures.
    #[error("temporary SMTP failure: {0}")]
    Temporary(String),
    /// Worth retrying later, but the relay may have taken the message: the conversation timed out
    /// before its answer, and a relay that had the whole message may still keep it after the
    /// client has gone.
    #[error("unconfirmed SMTP send: {0}")]
    Unconfirmed(String),
    /// Will never succeed as is: 5xx replies, an invalid recipient address.
    #[error("permanent mail failure: {0}")]
    Permanent(String),
}

/// What a receipt says.
#[derive(Clone, Debug)]
pub struct Receipt {
    pub ride_id: i64,
    pub to: String,
    pub amount: i64,
    pub currency: String,
    pub charge_id: String,
    pub ride_created_at: DateTime<Utc>,
}

/// SMTP connections a mailer keeps open by default (`SMTP_POOL_SIZE`).
pub const DEFAULT_SMTP_CONNECTIONS: u32 = 32;

/// One relay's transport: a pool of open SMTP connections, each reused for mail after mail (a
/// `NOOP` checks a parked one before reuse; one the relay closed is replaced), and at most
/// `connections` conversations at once ([`Mailer::connection`]).
#[derive(Clone)]
pub struct Mailer {
    transport: AsyncSmtpTransport<Tokio1Executor>,
    from: Mailbox,
    conversations: Arc<tokio::sync::Semaphore>,
}

impl Mailer {
    pub fn new(smtp_url: &str, from: &str, timeout: Duration) -> Result<Mailer, MailerConfigError> {
        Mailer::with_connections(smtp_url, from, timeout, DEFAULT_SMTP_CONNECTIONS)
    }

    /// A mailer keeping up to `connections` SMTP connections open.
    pub fn with_connections(
        smtp_url: &str,
        from: &str,
        timeout: Duration,
        connections: u32,
    ) -> Result<Mailer, MailerConfigError> {
        let connections = connections.max(1);
        let relay = parse_smtp_url(smtp_url).map_err(MailerConfigError::Url)?;
        let from: Mailbox = from.parse().map_err(|_| MailerConfigError::From)?;
        let mut builder = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(&relay.host)
            .port(relay.port)
            .timeout(Some(timeout))
            // Twice the conversations: lettre parks a connection again from a task of its own,
            // so the next conversation may start before it is back; kept rather than closed,
            // it is reused instead of a connection opened and closed per mail.
            .pool_config(PoolConfig::new().max_size(connections * 2).min_idle(0));
        if relay.security != Security::Plain {
            let tls = tls_parameters(&relay)?;
            builder = builder.tls(match relay.security {
                Security::StartTlsOpportunistic => Tls::Opportunistic(tls),
                Security::StartTlsRequired => Tls::Required(tls),
                Security::Plain | Security::Implicit => Tls::Wrapper(tls),
            });
        }
        if let Some((user, password)) = relay.credentials {
            builder = builder.credentials(Credentials::new(user, password));
        }
        Ok(Mailer {
            transport: builder.build(),
            from,
            conversations: Arc::new(tokio::sync::Semaphore::new(connections as usize)),
        })
    }

    /// Waits for one of the pool's connections to be free for a conversation: held while
    /// sending, so that a burst of mail queues here rather than opening a connection per mail
    /// (lettre's pool caps the connections it keeps, not the ones it opens). `None` never
    /// happens: the semaphore is never closed.
    pub async fn connection(&self) -> Option<tokio::sync::OwnedSemaphorePermit> {
        Arc::clone(&self.conversations).acquire_owned().await.ok()
    }

    pub async fn send(&self, receipt: &Receipt) -> Result<(), MailError> {
        let to: Mailbox = receipt
            .to
            .parse()
            .map_err(|_| MailError::Permanent("the rider's address is not valid".into()))?;
        let message = Message::builder()
            .from(self.from.clone())
            .to(to)
            .subject(format!(
                "Your Rocket Rides receipt for ride {}",
                receipt.ride_id
            ))
            .message_id(Some(receipt_message_id(receipt.ride_id)))
            .header(ContentType::TEXT_PLAIN)
            .body(body(receipt))
            .map_err(|error| MailError::Permanent(error.to_string()))?;
        match self.transport.send(message).await {
            Ok(_) => Ok(()),
            Err(error) if error.is_permanent() => Err(MailError::Permanent(error.to_string())),
            Err(error) if error.is_timeout() => Err(MailError::Unconfirmed(error.to_string())),
            // 4xx, refused connections, protocol hiccups: try again later.
            Err(error) => Err(MailError::Temporary(error.to_string())),
        }
    }
}

fn body(receipt: &Receipt) -> String {
    format!(
        "Thanks for riding with Rocket Rides!\r\n\
         \r\n\
         Ride:    {}\r\n\
         Date:    {}\r\n\
         Amount:  {}\r\n\
         Charge:  {}\r\n\
         \r\n\
         Keep this e-mail as your receipt.\r\n",
        receipt.ride_id,
        receipt.ride_created_at.format("%Y-%m-%d %H:%M UTC"),
        format_amount(receipt.amount, &receipt.currency),
        receipt.charge_id,
    )
}

/// Formats an amount in the currency's smallest unit ("2000", "usd" → "20.00 USD").
pub fn format_amount(amount: i64, currency: &str) -> String {
    // ISO 4217 currencies without minor units, as Stripe lists them.
    const ZERO_DECIMAL: [&str; 16] = [
        "bif", "clp", "djf", "gnf", "jpy", "kmf", "krw", "mga", "pyg", "rwf", "ugx", "vnd", "vuv",
        "xaf", "xof", "xpf",
    ];
    let code = currency.to_ascii_uppercase();
    if ZERO_DECIMAL.contains(&currency) {
        return format!("{amount} {code}");
    }
    let sign = if amount < 0 { "-" } else { "" };
    let cents = amount.unsigned_abs();
    format!("{sign}{}.{:02} {code}", cents / 100, cents % 100)
}

fn tls_parameters(relay: &Relay) -> Result<TlsParameters, MailerConfigError> {
    let mut tls = TlsParameters::builder(relay.host.clone());
    if let Some(path) = &relay.ca {
        let pem = std::fs::read(path).map_err(|source| MailerConfigError::CaFile {
            path: path.clone(),
            source,
        })?;
        tls =
            tls.add_root_certificate(Certificate::from_pem(&pem).map_err(MailerConfigError::Tls)?);
    }
    tls.build_rustls().map_err(MailerConfigError::Tls)
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Security {
    Plain,
    StartTlsOpportunistic,
    StartTlsRequired,
    Implicit,
}

/// What `SMTP_URL` says. Not `Debug`: it holds the password.
#[derive(PartialEq, Eq)]
struct Relay {
    host: String,
    port: u16,
    security: Security,
    credentials: Option<(String, String)>,
    ca: Option<PathBuf>,
}

/// Anything the module's documentation does not list (paths, unknown parameters, credentials
/// without TLS) is refused rather than silently ignored. The errors never repeat the URL.
fn parse_smtp_url(url: &str) -> Result<Relay, &'static str> {
    let url = reqwest::Url::parse(url).map_err(|_| "not a URL")?;
    let host = url
        .host_str()
        .filter(|host| !host.is_empty())
        .ok_or("no host")?;
    if !matches!(url.path(), "" | "/") || url.fragment().is_some() {
        return Err("a path is not allowed");
    }
    let mut tls = None;
    let mut ca = None;
    for (name, value) in url.query_pairs() {
        match &*name {
            "tls" => tls = Some(value.into_owned()),
            "cacertfile" => ca = Some(PathBuf::from(value.into_owned())),
            _ => return Err("unknown query parameter (tls and cacertfile are known)"),
        }
    }
    let security = match (url.scheme(), tls.as_deref()) {
        ("smtp", None) => Security::Plain,
        ("smtp", Some("opportunistic")) => Security::StartTlsOpportunistic,
        ("smtp", Some("required")) => Security::StartTlsRequired,
        ("smtps", None) => Security::Implicit,
        ("smtp", Some(_)) => return Err("tls must be required or opportunistic"),
        ("smtps", Some(_)) => return Err("smtps:// is TLS already; drop the tls parameter"),
        _ => return Err("the scheme must be smtp:// or smtps://"),
    };
    let port = url.port().unwrap_or(match security {
        Security::Plain => 25,
        Security::StartTlsOpportunistic | Security::StartTlsRequired => 587,
        Security::Implicit => 465,
    });
    let decode = |part: &str| {
        percent_decode(part).ok_or("the credentials are not valid percent-encoded UTF-8")
    };
    let credentials = match (url.username(), url.password()) {
        ("", None) => None,
        (user, Some(password)) => Some((decode(user)?, decode(password)?)),
        (_, None) => return Err("a user needs a password"),
    };
    if credentials.is_some() && !matches!(security, Security::StartTlsRequired | Security::Implicit)
    {
        return Err("credentials need TLS (smtps:// or ?tls=required)");
    }
    if ca.is_some() && security == Security::Plain {
        return Err("cacertfile needs TLS (smtps:// or ?tls=...)");
    }
    Ok(Relay {
        host: host.to_owned(),
        port,
        security,
        credentials,
        ca,
    })
}

fn percent_decode(part: &str) -> Option<String> {
    let bytes = part.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'%' {
            let hex = std::str::from_utf8(bytes.get(i + 1..i + 3)?).ok()?;
            out.push(u8::from_str_radix(hex, 16).ok()?);
            i += 3;
        } else {
            out.push(bytes[i]);
            i += 1;
        }
    }
    String::from_utf8(out).ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parsed(
        url: &str,
    ) -> (
        String,
        u16,
        Security,
        Option<(String, String)>,
        Option<PathBuf>,
    ) {
        let relay = parse_smtp_url(url).unwrap();
        (
            relay.host,
            relay.port,
            relay.security,
            relay.credentials,
            relay.ca,
        )
    }

    #[test]
    fn parses_smtp_urls() {
        assert_eq!(
            parsed("smtp://127.0.0.1:2525"),
            ("127.0.0.1".into(), 2525, Security::Plain, None, None)
        );
        assert_eq!(
            parsed("smtp://mail.internal"),
            ("mail.internal".into(), 25, Security::Plain, None, None)
        );
        assert_eq!(
            parsed("smtp://receipts%40rides:p%40ss%3Aw@relay.example?tls=required"),
            (
                "relay.example".into(),
                587,
                Security::StartTlsRequired,
                Some(("receipts@rides".into(), "p@ss:w".into())),
                None
            )
        );
        assert_eq!(
            parsed("smtps://u:p@relay.example?cacertfile=%2Fetc%2Fca.pem"),
            (
                "relay.example".into(),
                465,
                Security::Implicit,
                Some(("u".into(), "p".into())),
                Some(PathBuf::from("/etc/ca.pem"))
            )
        );
        assert_eq!(
            parsed("smtp://relay:2587?tls=opportunistic").2,
            Security::StartTlsOpportunistic
        );
    }

    #[test]
    fn refuses_what_it_cannot_honour() {
        for url in [
            "smtp://user:pw@x:25",
            "smtp://user:pw@x?tls=opportunistic",
            "smtp://user@x?tls=required",
            "smtp://x:notaport",
            "smtp://x/path",
            "smtp://x?tls=maybe",
            "smtp://x?cacertfile=/ca.pem",
            "smtps://x?tls=required",
            "smtp://x?verify=none",
            "http://x",
            "not a url",
        ] {
            assert!(parse_smtp_url(url).is_err(), "{url}");
        }
    }

    #[test]
    fn errors_do_not_repeat_the_password() {
        let Err(error) = Mailer::new(
            "smtp://user:hunter2@x:25",
            DEFAULT_FROM_FOR_TESTS,
            Duration::from_secs(1),
        ) else {
            panic!("credentials without TLS were accepted");
        };
        assert!(!error.to_string().contains("hunter2"), "{error}");
    }

    const DEFAULT_FROM_FOR_TESTS: &str = "Rocket Rides <receipts@rocketrides.test>";

    #[test]
    fn formats_amounts() {
        assert_eq!(format_amount(2000, "usd"), "20.00 USD");
        assert_eq!(format_amount(5, "eur"), "0.05 EUR");
        assert_eq!(format_amount(500, "jpy"), "500 JPY");
    }

    #[test]
    fn message_ids_are_deterministic() {
        assert_eq!(receipt_message_id(42), "<ride-42.receipt@rocketrides.test>");
    }
}
