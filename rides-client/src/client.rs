//! [`RidesClient`]: the calls, and the one retry loop they share.

use std::{
    future::Future,
    sync::Arc,
    time::{Duration, Instant},
};

use proto::{
    client::{ClientTls, EndpointError},
    v1::{CreateRideRequest, GetRideRequest, ride_service_client::RideServiceClient},
};
use rand::Rng;
use tonic::{
    Request, Response, Status,
    metadata::{AsciiMetadataValue, MetadataMap},
    transport::Channel,
};
use tracing::{Instrument, Span};

use crate::{
    attempt::{AttemptRecord, Created, Fetched},
    credential::Credential,
    error::{CallError, RidesError},
    policy::RetryPolicy,
    span::{finish_call_span, inject_trace_context, record_code, rpc_span},
};

/// The service whose methods every span names: `rpc.method` is `{SERVICE}/{method}`.
pub(crate) const SERVICE: &str = "rides.v1.RideService";

/// Called after every attempt with its record (its `wait` filled in when there is a next one):
/// for live counters, such as the proof campaign's.
pub type AttemptObserver = Arc<dyn Fn(&AttemptRecord) + Send + Sync>;

/// A client of `rides.v1.RideService`. Cheap to clone (channels are shared); the `with_*`
/// methods return a changed copy, so one connection can serve many users and policies.
#[derive(Clone)]
pub struct RidesClient {
    /// One or more endpoints; each attempt goes to one at random, so that the retry after a
    /// server's failure may reach another one (a client without a balancer in front).
    targets: Arc<[RideServiceClient<Channel>]>,
    credential: Credential,
    policy: RetryPolicy,
    observer: Option<AttemptObserver>,
}

impl std::fmt::Debug for RidesClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RidesClient")
            .field("targets", &self.targets.len())
            .field("credential", &self.credential)
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

impl RidesClient {
    /// A client of the api-server at `url` (`http://`, or `https://` with `tls`: a private CA
    /// and, for mutual TLS, a client certificate), built by [`proto::client::endpoint`]. The
    /// connection is made on first use and remade after a failure.
    pub fn connect_lazy(
        url: &str,
        tls: &ClientTls,
        credential: Credential,
    ) -> Result<RidesClient, EndpointError> {
        let channel = proto::client::endpoint(url, tls)?
            .connect_timeout(Duration::from_secs(10))
            .connect_lazy();
        Ok(RidesClient::new(channel, credential))
    }

    /// A client over an existing channel.
    pub fn new(channel: Channel, credential: Credential) -> RidesClient {
        RidesClient::with_targets(channel, [], credential)
    }

    /// A client of several api-servers: each attempt picks one at random.
    pub fn with_targets(
        first: Channel,
        more: impl IntoIterator<Item = Channel>,
        credential: Credential,
    ) -> RidesClient {
        let targets: Vec<_> = std::iter::once(first)
            .chain(more)
            .map(RideServiceClient::new)
            .collect();
        RidesClient {
            targets: targets.into(),
            credential,
            policy: RetryPolicy::default(),
            observer: None,
        }
    }

    pub fn with_policy(mut self, policy: RetryPolicy) -> RidesClient {
        self.policy = policy;
        self
    }

    pub fn with_credential(mut self, credential: Credential) -> RidesClient {
        self.credential = credential;
        self
    }

    pub fn on_attempt(mut self, observer: AttemptObserver) -> RidesClient {
        self.observer = Some(observer);
        self
    }

    pub fn policy(&self) -> &RetryPolicy {
        &self.policy
    }

    /// CreateRide as a new logical request: a key is generated here, once, and every retry of
    /// this call sends it, so the rider is charged at most once however often it is retried.
    pub async fn create_ride(&self, params: CreateRideRequest) -> Result<Created, CallError> {
        self.create_ride_with_key(new_key(), params).await
    }

    /// CreateRide with the caller's key, sent for the first time (a key the caller derives from
    /// its own request, say). The same key with other parameters is `IdempotencyKeyReused`. Its
    /// retries say they resend the key (`idempotency-key-resent`), as every attempt of
    /// [`RidesClient::resume_ride`] does.
    pub async fn create_ride_with_key(
        &self,
        key: impl Into<String>,
        params: CreateRideRequest,
    ) -> Result<Created, CallError> {
        self.create_ride_sending(key.into(), false, params).await
    }

    /// CreateRide with a key this caller has sent before: to resume a logical request after this
    /// process restarted, or to ask again for the answer of one it made. Every attempt says so
    /// (`idempotency-key-resent`), and the server looks the key up before it writes anything:
    /// cheaper for a key that exists, one statement dearer for one that does not.
    pub async fn resume_ride(
        &self,
        key: impl Into<String>,
        params: CreateRideRequest,
    ) -> Result<Created, CallError> {
        self.create_ride_sending(key.into(), true, params).await
    }

    async fn create_ride_sending(
        &self,
        key: String,
        sent_before: bool,
        params: CreateRideRequest,
    ) -> Result<Created, CallError> {
        let span = rpc_span("CreateRide", None, Some(&key));
        let result = self
            .call(
                "CreateRide",
                Some(SentKey {
                    key: &key,
                    before: sent_before,
                }),
                params,
                |mut rpc, request| async move { rpc.create_ride(request).await },
            )
            .instrument(span.clone())
            .await;
        let created = result.and_then(|(response, log)| {
            let replayed = header(response.metadata(), proto::metadata::IDEMPOTENT_REPLAYED)
                .is_some_and(|value| value == "true");
            let expires_at = header(
                response.metadata(),
                proto::metadata::IDEMPOTENCY_KEY_EXPIRES_AT,
            );
            let body = response.into_inner();
            match body.ride {
                Some(ride) => Ok(Created {
                    ride,
                    message: body.message,
                    key: key.clone(),
                    replayed,
                    expires_at,
                    log,
                }),
                None => Err((RidesError::MissingRide, log)),
            }
        });
        if let Ok(created) = &created {
            span.record("rides.replayed", created.replayed);
        }
        created.map_err(|(error, log)| CallError {
            method: "CreateRide",
            key: Some(key),
            log,
            error,
        })
    }

    /// GetRide: one of the caller's own rides (a user credential; the internal one is refused).
    /// A read, so it is retried like CreateRide but needs no key.
    pub async fn get_ride(&self, id: i64) -> Result<Fetched, CallError> {
        let span = rpc_span("GetRide", None, None);
        self.call(
            "GetRide",
            None,
            GetRideRequest { id },
            |mut rpc, request| async move { rpc.get_ride(request).await },
        )
        .instrument(span)
        .await
        .map(|(response, log)| Fetched {
            ride: response.into_inner(),
            log,
        })
        .map_err(|(error, log)| CallError {
            method: "GetRide",
            key: None,
            log,
            error,
        })
    }

    /// The retry loop: attempts until success, an error that is not retryable, the last
    /// attempt, or a wait that would pass the deadline.
    async fn call<B, R, F, Fut>(
        &self,
        method: &'static str,
        key: Option<SentKey<'_>>,
        body: B,
        send: F,
    ) -> Result<(Response<R>, Vec<AttemptRecord>), (RidesError, Vec<AttemptRecord>)>
    where
        B: Clone,
        F: Fn(RideServiceClient<Channel>, Request<B>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        let policy = &self.policy;
        let deadline = Instant::now().checked_add(policy.deadline);
        let remaining = || {
            deadline.map_or(Duration::MAX, |d| {
                d.saturating_duration_since(Instant::now())
            })
        };
        let mut log: Vec<AttemptRecord> = Vec::new();
        for number in 1..=policy.attempts() {
            let timeout = policy.attempt_timeout.min(remaining());
            let target = self.pick_target();
            let started = Instant::now();
            // Every attempt after the first resends the key.
            let key = key.map(|key| SentKey {
                before: key.before || number > 1,
                ..key
            });
            let answer = self
                .attempt(method, number, target, timeout, key, body.clone(), &send)
                .await;
            let elapsed = started.elapsed();
            let error = match answer {
                // Nothing was sent (the token or key cannot be metadata): no attempt to log.
                Err(unsendable) => return Err((unsendable, log)),
                Ok(Ok(response)) => {
                    finish_call_span(number, Some(tonic::Code::Ok));
                    let record = self.record(number, target, "OK".to_owned(), elapsed, None, None);
                    log.push(record);
                    return Ok((response, log));
                }
                Ok(Err(error)) => error,
            };
            let remaining = remaining();
            match self.after_error(number, target, elapsed, error, remaining, &mut log) {
                Ok(wait) => tokio::time::sleep(wait).await,
                Err(answer) => return Err((answer, log)),
            }
        }
        // Unreachable in practice: the last attempt returns above. Kept total, not panicking.
        Err((
            RidesError::DeadlineExceeded {
                deadline: policy.deadline,
                last: None,
            },
            log,
        ))
    }

    /// Logs a failed attempt and decides what follows it: the wait before the next attempt, or
    /// (`Err`) the call's answer: the error itself when it is not retryable or this was the last
    /// attempt, `DeadlineExceeded` when the deadline leaves no time for another.
    fn after_error(
        &self,
        number: u32,
        target: usize,
        elapsed: Duration,
        error: RidesError,
        remaining: Duration,
        log: &mut Vec<AttemptRecord>,
    ) -> Result<Duration, RidesError> {
        let policy = &self.policy;
        let retry_info = error.retry_after();
        let wait = (error.is_retryable() && number < policy.attempts())
            .then(|| policy.wait(number, retry_info, remaining, rand::rng().random()));
        let record = self.record(
            number,
            target,
            error.label(),
            elapsed,
            retry_info,
            wait.flatten(),
        );
        log.push(record);
        match wait {
            None => {
                finish_call_span(number, error.code());
                Err(error)
            }
            Some(None) => {
                finish_call_span(number, Some(tonic::Code::DeadlineExceeded));
                Err(RidesError::DeadlineExceeded {
                    deadline: policy.deadline,
                    last: Some(Box::new(error)),
                })
            }
            Some(Some(wait)) => {
                tracing::debug!(
                    attempt = number,
                    outcome = %error.label(),
                    ?wait,
                    "retrying with the same key"
                );
                Ok(wait)
            }
        }
    }

    /// One attempt, in its own span, bounded by `timeout`, to `target`: its answer, or (outer
    /// `Err`) why the request could not be built, in which case nothing was sent.
    #[allow(clippy::too_many_arguments)] // the loop's state for one attempt, each used once
    async fn attempt<B, R, F, Fut>(
        &self,
        method: &'static str,
        number: u32,
        target: usize,
        timeout: Duration,
        key: Option<SentKey<'_>>,
        body: B,
        send: &F,
    ) -> Result<Result<Response<R>, RidesError>, RidesError>
    where
        F: Fn(RideServiceClient<Channel>, Request<B>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        let span = rpc_span(method, Some(number), None);
        let request = self.request(body, key, timeout, &span)?;
        // `targets` is never empty (`with_targets` takes a first channel); `target` is below its
        // length.
        let rpc = self.targets[target].clone();
        let sent = std::time::Instant::now();
        let answer = tokio::time::timeout(timeout, send(rpc, request))
            .instrument(span.clone())
            .await;
        let result = match answer {
            Ok(Ok(response)) => Ok(response),
            // tonic enforces the `grpc-timeout` it sends as well, and may notice first; so does
            // the server, which then answers CANCELLED "Timeout expired" at the same moment.
            Ok(Err(status))
                if timed_out_here(&status)
                    || (status.code() == tonic::Code::Cancelled && sent.elapsed() >= timeout) =>
            {
                Err(RidesError::AttemptTimedOut(timeout))
            }
            Ok(Err(status)) => Err(RidesError::from(status)),
            Err(_elapsed) => Err(RidesError::AttemptTimedOut(timeout)),
        };
        record_code(
            &span,
            match &result {
                Ok(_) => Some(tonic::Code::Ok),
                Err(error) => error.code(),
            },
        );
        Ok(result)
    }

    fn pick_target(&self) -> usize {
        match self.targets.len() {
            0 | 1 => 0,
            n => rand::rng().random_range(0..n),
        }
    }

    /// The request of one attempt: credential, key (and `idempotency-wait` if the policy sets
    /// one), `grpc-timeout` and the trace context of the attempt's span.
    fn request<B>(
        &self,
        body: B,
        key: Option<SentKey<'_>>,
        timeout: Duration,
        attempt_span: &Span,
    ) -> Result<Request<B>, RidesError> {
        let mut request = Request::new(body);
        request.set_timeout(timeout);
        let metadata = request.metadata_mut();
        self.credential
            .apply(metadata)
            .map_err(|_| RidesError::InvalidMetadata("token"))?;
        if let Some(SentKey { key, before }) = key {
            let value = AsciiMetadataValue::try_from(key)
                .map_err(|_| RidesError::InvalidMetadata("idempotency key"))?;
            metadata.insert(proto::metadata::IDEMPOTENCY_KEY, value);
            if before {
                metadata.insert(
                    proto::metadata::IDEMPOTENCY_KEY_RESENT,
                    AsciiMetadataValue::from_static("true"),
                );
            }
            // Absent, the server waits as long as it allows (`RetryPolicy::idempotency_wait`).
            if let Some(wait) = self.policy.idempotency_wait {
                // Digits only: always a valid header value. The server reads at most 8 digits.
                let millis = wait.as_millis().min(99_999_999).to_string();
                if let Ok(value) = AsciiMetadataValue::try_from(millis) {
                    metadata.insert(proto::metadata::IDEMPOTENCY_WAIT, value);
                }
            }
        }
        inject_trace_context(metadata, attempt_span);
        Ok(request)
    }

    fn record(
        &self,
        number: u32,
        target: usize,
        outcome: String,
        elapsed: Duration,
        retry_info: Option<Duration>,
        wait: Option<Duration>,
    ) -> AttemptRecord {
        let record = AttemptRecord {
            number,
            target,
            outcome,
            elapsed,
            retry_info,
            wait,
        };
        if let Some(observer) = &self.observer {
            observer(&record);
        }
        record
    }
}

/// A fresh idempotency key: `rr-` and a random UUID (39 visible ASCII characters, within the
/// server's 20 to 255), unique per logical request.
pub fn new_key() -> String {
    format!("rr-{}", uuid::Uuid::new_v4())
}

/// A CreateRide key as an attempt sends it: the key, and whether the caller has sent it before.
#[derive(Clone, Copy)]
struct SentKey<'a> {
    key: &'a str,
    before: bool,
}

/// Whether the status is tonic's own report of this side's timeout (`TimeoutExpired` below it),
/// not an answer.
fn timed_out_here(status: &Status) -> bool {
    let mut source = std::error::Error::source(status);
    while let Some(error) = source {
        if error.is::<tonic::TimeoutExpired>() {
            return true;
        }
        source = error.source();
    }
    false
}

fn header(metadata: &MetadataMap, name: &str) -> Option<String> {
    metadata
        .get(name)
        .and_then(|value| value.to_str().ok())
        .map(str::to_owned)
}
