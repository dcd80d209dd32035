//! Receipt e-mails over SMTP with lettre. Plain SMTP only (`smtp://host:port`): the relay is a
//! local MTA or the development mail sink; TLS and authentication would be a lettre feature and a
//! URL scheme away.

use std::time::Duration;

use chrono::{DateTime, Utc};
use lettre::{
    AsyncSmtpTransport, AsyncTransport, Message, Tokio1Executor,
    message::{Mailbox, header::ContentType},
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
    #[error("SMTP_URL must look like smtp://host:port (no TLS, no credentials)")]
    Url,
    #[error("RECEIPT_FROM is not a valid mailbox")]
    From,
}

#[derive(Debug, thiserror::Error)]
pub enum MailError {
    /// Worth retrying later: 4xx replies, connection failures, timeouts.
    #[error("temporary SMTP failure: {0}")]
    Temporary(String),
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

#[derive(Clone)]
pub struct Mailer {
    transport: AsyncSmtpTransport<Tokio1Executor>,
    from: Mailbox,
}

impl Mailer {
    pub fn new(smtp_url: &str, from: &str, timeout: Duration) -> Result<Mailer, MailerConfigError> {
        let (host, port) = parse_smtp_url(smtp_url).ok_or(MailerConfigError::Url)?;
        let from: Mailbox = from.parse().map_err(|_| MailerConfigError::From)?;
        let transport = AsyncSmtpTransport::<Tokio1Executor>::builder_dangerous(host)
            .port(port)
            .timeout(Some(timeout))
            .build();
        Ok(Mailer { transport, from })
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
            // 4xx, refused connections, timeouts, protocol hiccups: try again later.
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

/// `smtp://host[:port]` → (host, port). Anything else (TLS schemes, credentials, paths) is
/// refused rather than silently ignored.
fn parse_smtp_url(url: &str) -> Option<(String, u16)> {
    let rest = url.strip_prefix("smtp://")?.trim_end_matches('/');
    if rest.is_empty() || rest.contains(['@', '/', '?']) {
        return None;
    }
    match rest.rsplit_once(':') {
        Some((host, port)) if !host.is_empty() => Some((host.to_owned(), port.parse().ok()?)),
        Some(_) => None,
        None => Some((rest.to_owned(), 25)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_smtp_urls() {
        assert_eq!(
            parse_smtp_url("smtp://127.0.0.1:2525"),
            Some(("127.0.0.1".to_owned(), 2525))
        );
        assert_eq!(
            parse_smtp_url("smtp://mail.internal"),
            Some(("mail.internal".to_owned(), 25))
        );
        assert_eq!(parse_smtp_url("smtps://x:465"), None);
        assert_eq!(parse_smtp_url("smtp://user:pw@x:25"), None);
        assert_eq!(parse_smtp_url("smtp://x:notaport"), None);
    }

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
