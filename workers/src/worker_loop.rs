//! The one loop of the scheduled workers (enqueuer, completer, reaper, reconciler): each says
//! only what one pass does and when the next is due ([`Passes`]), and [`run_passes`] runs it
//! until the shutdown token ([`crate::shutdown`]) is cancelled.

use tokio_util::sync::CancellationToken;

/// Sleeps for `duration` unless shutdown comes first. Returns false if it was cut short.
pub async fn sleep(token: &CancellationToken, duration: std::time::Duration) -> bool {
    tokio::select! {
        () = token.cancelled() => false,
        () = tokio::time::sleep(duration) => true,
    }
}

/// What a worker's pass asks of the next one.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Next {
    /// There is more to do: go again at once.
    Now,
    /// Nothing more for now: wait this long.
    After(std::time::Duration),
}

/// A scheduled worker's pass (enqueuer, completer, reaper), run by [`run_passes`].
pub trait Passes {
    type Error: std::error::Error + 'static;
    /// For the logs.
    const WORKER: &'static str;

    fn pass(&mut self) -> impl Future<Output = Result<Next, Self::Error>> + Send;
}

/// The one loop of every scheduled worker: runs passes until shutdown, again at once or after the
/// delay a pass asks for; after a failed pass, logs it and waits `failing`'s next delay (reset by
/// a pass that succeeds). A pass in flight is never cut: shutdown is seen between passes and
/// during the waits.
pub async fn run_passes<P: Passes>(
    passes: &mut P,
    token: &CancellationToken,
    mut failing: crate::backoff::Backoff,
) {
    while !token.is_cancelled() {
        let delay = match passes.pass().await {
            Ok(Next::Now) => {
                failing.reset();
                continue;
            }
            Ok(Next::After(delay)) => {
                failing.reset();
                delay
            }
            Err(error) => {
                let delay = failing.next_delay();
                tracing::error!(
                    worker = P::WORKER,
                    error = %telemetry::error_chain(&error),
                    ?delay,
                    "pass failed, retrying"
                );
                delay
            }
        };
        if !sleep(token, delay).await {
            break;
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::backoff::Backoff;

    /// Fails once, has more work twice, then is idle; shuts down during its idle wait.
    struct Script {
        calls: u32,
        token: CancellationToken,
    }

    impl Passes for Script {
        type Error = std::io::Error;
        const WORKER: &'static str = "script";

        async fn pass(&mut self) -> Result<Next, std::io::Error> {
            self.calls += 1;
            match self.calls {
                1 => Err(std::io::Error::other("broker gone")),
                2 | 3 => Ok(Next::Now),
                _ => {
                    self.token.cancel();
                    Ok(Next::After(Duration::from_secs(3600)))
                }
            }
        }
    }

    #[tokio::test]
    async fn passes_retry_after_a_failure_go_again_when_asked_and_stop_on_shutdown() {
        let token = CancellationToken::new();
        let mut script = Script {
            calls: 0,
            token: token.clone(),
        };
        let failing = Backoff::new(Duration::from_millis(1), Duration::from_millis(1));
        let ran = tokio::time::timeout(
            Duration::from_secs(10),
            run_passes(&mut script, &token, failing),
        )
        .await;
        assert!(ran.is_ok(), "shutdown did not cut the idle wait");
        assert_eq!(script.calls, 4);
    }
}
