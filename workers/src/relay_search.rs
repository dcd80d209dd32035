//! Asks the mail relay whether it already accepted a message, by Message-ID.
//!
//! SMTP has no idempotency key: when an attempt crashes after the relay said `250` but before the
//! send was recorded, only the relay knows the mail went out. This is the receipt worker's
//! equivalent of looking a PaymentIntent up at Stripe before charging again. The API is Mailpit's
//! message search (`GET /api/v1/search?query=message-id:<id>`), which the development mail sink
//! (`mail-sink --http-listen`, its own crate) also serves; a production relay with a message-events API
//! (SES, Postmark, Mailgun) fits behind the same call.

use std::time::Duration;

use serde::Deserialize;

#[derive(Debug, thiserror::Error)]
pub enum SearchError {
    #[error("MAIL_SEARCH_URL must be an http:// or https:// URL")]
    Url,
    #[error("the relay's message search failed")]
    Request(#[from] reqwest::Error),
}

#[derive(Clone)]
pub struct RelaySearch {
    http: reqwest::Client,
    search_url: String,
}

/// The part of Mailpit's search answer this needs.
#[derive(Debug, Deserialize)]
struct SearchAnswer {
    #[serde(default)]
    messages: Vec<Summary>,
}

#[derive(Debug, Deserialize)]
struct Summary {
    #[serde(rename = "MessageID", default)]
    message_id: String,
}

impl RelaySearch {
    pub fn new(base_url: &str, timeout: Duration) -> Result<RelaySearch, SearchError> {
        let base = base_url.trim_end_matches('/');
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            return Err(SearchError::Url);
        }
        let http = reqwest::Client::builder().timeout(timeout).build()?;
        Ok(RelaySearch {
            http,
            search_url: format!("{base}/api/v1/search"),
        })
    }

    /// Whether the relay holds a message with this Message-ID (with or without angle brackets).
    pub async fn holds(&self, message_id: &str) -> Result<bool, SearchError> {
        let wanted = bare(message_id);
        let answer: SearchAnswer = self
            .http
            .get(&self.search_url)
            .query(&[("query", format!("message-id:{wanted}"))])
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        // A search may match loosely; only the exact id counts.
        Ok(answer
            .messages
            .iter()
            .any(|m| bare(&m.message_id) == wanted))
    }
}

/// `<id@host>` → `id@host`.
pub fn bare(message_id: &str) -> &str {
    let trimmed = message_id.trim();
    trimmed
        .strip_prefix('<')
        .and_then(|rest| rest.strip_suffix('>'))
        .unwrap_or(trimmed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strips_angle_brackets_only_in_pairs() {
        assert_eq!(bare("<a@b>"), "a@b");
        assert_eq!(bare(" a@b "), "a@b");
        assert_eq!(bare("<a@b"), "<a@b");
    }

    #[test]
    fn refuses_non_http_urls() {
        let timeout = Duration::from_secs(1);
        assert!(RelaySearch::new("smtp://relay:25", timeout).is_err());
        assert!(RelaySearch::new("http://relay:8025/", timeout).is_ok());
    }
}
