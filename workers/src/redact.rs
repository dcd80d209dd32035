//! Shortening values that must not reach logs in full.

/// `r***@example.com`: enough to tell two riders apart in a log, not enough to mail them.
pub fn email(address: &str) -> String {
    match address.split_once('@') {
        Some((local, domain)) => {
            let first = local.chars().next().map(String::from).unwrap_or_default();
            format!("{first}***@{domain}")
        }
        None => "***".to_owned(),
    }
}

/// The first six characters of an idempotency key, as the api-server logs them.
pub fn key(key: &str) -> String {
    let prefix: String = key.chars().take(6).collect();
    format!("{prefix}…")
}

/// A URL with whatever precedes its host's `@` (the user and password) replaced by `***`,
/// whether or not the URL is well formed: `amqps:user:secret@host` is `amqps:***@host`.
pub fn url(url: &str) -> String {
    let Some((before, host)) = url.rsplit_once('@') else {
        return url.to_owned();
    };
    let scheme = before.split_once(':').map_or("", |(scheme, _)| scheme);
    let after_scheme = before.get(scheme.len() + 1..).unwrap_or_default();
    let slashes = &after_scheme[..after_scheme.len() - after_scheme.trim_start_matches('/').len()];
    if scheme.is_empty() {
        format!("***@{host}")
    } else {
        format!("{scheme}:{slashes}***@{host}")
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts() {
        assert_eq!(super::email("rider-1@example.com"), "r***@example.com");
        assert_eq!(super::email("nonsense"), "***");
        assert_eq!(super::key("test-key-0123456789"), "test-k…");
        assert_eq!(super::url("amqps:user:secret@host"), "amqps:***@host");
        assert_eq!(
            super::url("amqp://user:secret@host:5672/%2f"),
            "amqp://***@host:5672/%2f"
        );
        assert_eq!(super::url("amqp://host/%2f"), "amqp://host/%2f");
    }
}
