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

#[cfg(test)]
mod tests {
    #[test]
    fn redacts() {
        assert_eq!(super::email("rider-1@example.com"), "r***@example.com");
        assert_eq!(super::email("nonsense"), "***");
        assert_eq!(super::key("test-key-0123456789"), "test-k…");
    }
}
