//! The test harness (feature `testing`): a `TestApp` per test with its own database (cloned from
//! a migrated template), its own fake-stripe on port 0 and the real gRPC server on port 0, reached
//! by a real tonic client over loopback. Used by this crate's tests and by the workers' tests.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod tls;

pub use self::tls::{TestCa, TlsFiles};

use std::{collections::HashMap, net::SocketAddr, sync::Arc};

use crate::{
    App,
    auth::Caller,
    config::Config,
    grpc::{EXPIRES_AT_HEADER, IDEMPOTENCY_KEY_HEADER, REPLAYED_HEADER},
    idempotency::{self, Decision, IdempotencyKey, Lease},
    rides::{RideParams, RideRequest, Rides},
};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use fake_stripe::FakeStripe;
use proto::v1::{CreateRideRequest, CreateRideResponse, ride_service_client::RideServiceClient};
use schema::{
    Pool, RecoveryPoint,
    models::{AuditRecord, IdempotencyKeyRow as KeyRow, Ride, StagedJob, User},
    schema::{audit_records, idempotency_keys, rides, staged_jobs, users},
    testing::TestDatabase,
};
use tokio::{sync::oneshot, task::JoinHandle};
use tonic::{
    Code, Request, Response, Status,
    transport::{Channel, ClientTlsConfig},
};
use tonic_types::StatusExt;

pub const DECLINED_CARD: &str = "pm_card_chargeDeclined";
pub const GOOD_CARD: &str = "pm_card_visa";
/// The completer's credential in every TestApp.
pub const INTERNAL_API_TOKEN: &str = "internal-test-token-0123456789abcdef";

/// The per-user limits every TestApp starts with: high enough never to refuse a test's calls.
pub const UNLIMITED: &[(&str, &str)] = crate::limits::LIFTED;

/// How long [`TestApp::spawn_on`] waits for the server to report SERVING before handing it over.
pub const READY_WITHIN: std::time::Duration = std::time::Duration::from_secs(3);

pub struct TestApp {
    pub db: TestDatabase,
    pub pool: Pool,
    pub stripe: FakeStripe,
    pub addr: SocketAddr,
    pub rides: Arc<Rides>,
    pub app: App,
    pub config: Config,
    shutdown: Option<oneshot::Sender<()>>,
    server: Option<JoinHandle<()>>,
}

#[derive(Clone, Debug)]
pub struct TestUser {
    pub id: i64,
    pub token: String,
}

impl TestApp {
    pub async fn spawn() -> TestApp {
        TestApp::spawn_with(fake_stripe::Config::default(), &[]).await
    }

    /// `overrides` are extra environment variables for the server's configuration. The per-user
    /// limits are lifted (see [`UNLIMITED`]) unless an override sets them: tests create many rides
    /// quickly for one user.
    pub async fn spawn_with(
        stripe_config: fake_stripe::Config,
        overrides: &[(&str, &str)],
    ) -> TestApp {
        let db = TestDatabase::new().await;
        let url = db.url().to_owned();
        TestApp::spawn_on(db, &url, stripe_config, overrides).await
    }

    /// [`TestApp::spawn_with`] on `db`, which the server reaches at `server_database_url` (a
    /// proxy in front of it, say) while the test's own pool connects to it directly.
    pub async fn spawn_on(
        db: TestDatabase,
        server_database_url: &str,
        stripe_config: fake_stripe::Config,
        overrides: &[(&str, &str)],
    ) -> TestApp {
        let stripe = FakeStripe::spawn(stripe_config).await.unwrap();
        let mut vars: HashMap<String, String> = HashMap::from([
            ("DATABASE_URL".to_owned(), server_database_url.to_owned()),
            ("STRIPE_API_BASE".to_owned(), stripe.base_url()),
            ("STRIPE_SECRET_KEY".to_owned(), "sk_test_harness".to_owned()),
            ("STRIPE_TIMEOUT_MS".to_owned(), "2000".to_owned()),
            ("DATABASE_POOL_SIZE".to_owned(), "8".to_owned()),
            (
                "INTERNAL_API_TOKEN".to_owned(),
                INTERNAL_API_TOKEN.to_owned(),
            ),
        ]);
        for (name, value) in UNLIMITED {
            vars.insert((*name).to_owned(), (*value).to_owned());
        }
        for (name, value) in overrides {
            vars.insert((*name).to_owned(), (*value).to_owned());
        }
        let config = Config::from_lookup(|name| vars.get(name).cloned()).unwrap();
        let app = App::from_config(&config).unwrap();
        let rides = Arc::clone(&app.rides);
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let (shutdown, shutdown_rx) = oneshot::channel::<()>();
        let server_app = app.clone();
        let server = tokio::spawn(async move {
            crate::server::serve(listener, server_app, async {
                let _ = shutdown_rx.await;
            })
            .await
            .unwrap();
        });
        // A server reports SERVING once its database and liveness session are up: tests that
        // read health start from there. A server that cannot get there (an unreachable database,
        // a liveness session held down) is handed over after the bound, as it is.
        let mut ready = app.readiness();
        let _ = tokio::time::timeout(READY_WITHIN, ready.wait_for(|ready| *ready)).await;
        TestApp {
            pool: db.pool(4),
            db,
            stripe,
            addr,
            rides,
            app,
            config,
            shutdown: Some(shutdown),
            server: Some(server),
        }
    }

    /// The provider forgets idempotency keys after its window (Stripe: 24 h; here 1 s on both
    /// sides), so a key resumed after a second searches for its earlier charge.
    pub async fn spawn_with_a_short_provider_key_window() -> TestApp {
        TestApp::spawn_with(
            fake_stripe::Config {
                idempotency_window: std::time::Duration::from_secs(1),
                ..Default::default()
            },
            &[("STRIPE_IDEMPOTENCY_WINDOW_SECS", "1")],
        )
        .await
    }

    pub async fn client(&self) -> RideServiceClient<Channel> {
        RideServiceClient::connect(format!("http://{}", self.addr))
            .await
            .unwrap()
    }

    pub async fn channel(&self) -> Channel {
        Channel::from_shared(format!("http://{}", self.addr))
            .unwrap()
            .connect()
            .await
            .unwrap()
    }

    /// A channel over TLS to a server spawned with [`TlsFiles::env`]; the server's certificate
    /// is for `localhost`.
    pub async fn tls_channel(
        &self,
        tls: ClientTlsConfig,
    ) -> Result<Channel, tonic::transport::Error> {
        Channel::from_shared(format!("https://{}", self.addr))
            .unwrap()
            .tls_config(tls.domain_name("localhost"))?
            .connect()
            .await
    }

    pub async fn create_user(&self, payment_method: &str) -> TestUser {
        let suffix = uuid::Uuid::new_v4().simple().to_string();
        let (user, token) = crate::auth::create_user(
            &self.pool,
            &format!("rider-{suffix}@example.com"),
            &format!("cus_{suffix}"),
            payment_method,
        )
        .await
        .unwrap();
        TestUser { id: user.id, token }
    }

    pub async fn create_ride(
        &self,
        user: &TestUser,
        key: &str,
        body: CreateRideRequest,
    ) -> Result<Response<CreateRideResponse>, Status> {
        self.client()
            .await
            .create_ride(authed(&user.token, Some(key), body))
            .await
    }

    /// One CreateRide attempt whose provider call fails before any charge (a 500): the key is
    /// left at `ride_created`, unlocked, with its ride and no PaymentIntent.
    pub async fn fail_at_the_provider(&self, user: &TestUser, key: &str) -> Status {
        self.stripe
            .inject_faults(fake_stripe::FaultMode::Error500, 1);
        self.create_ride(user, key, ride_request())
            .await
            .unwrap_err()
    }

    /// Shuts the server down gracefully and waits for it to drain.
    pub async fn shutdown(&mut self) {
        self.begin_shutdown();
        if let Some(server) = self.server.take() {
            server.await.unwrap();
        }
    }

    /// Signals shutdown (as SIGTERM would) without waiting; returns the server task to await.
    pub fn begin_shutdown(&mut self) -> Option<JoinHandle<()>> {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        self.server.take()
    }

    pub async fn key_row(&self, user: &TestUser, key: &str) -> Option<KeyRow> {
        let mut conn = self.pool.get().await.unwrap();
        idempotency_keys::table
            .filter(idempotency_keys::user_id.eq(user.id))
            .filter(idempotency_keys::idempotency_key.eq(key))
            .select(KeyRow::as_select())
            .first(&mut conn)
            .await
            .optional()
            .unwrap()
    }

    pub async fn rides(&self) -> Vec<Ride> {
        let mut conn = self.pool.get().await.unwrap();
        rides::table
            .order(rides::id)
            .select(Ride::as_select())
            .load(&mut conn)
            .await
            .unwrap()
    }

    pub async fn staged_jobs(&self) -> Vec<StagedJob> {
        let mut conn = self.pool.get().await.unwrap();
        staged_jobs::table
            .order(staged_jobs::id)
            .select(StagedJob::as_select())
            .load(&mut conn)
            .await
            .unwrap()
    }

    pub async fn audit_records(&self) -> Vec<AuditRecord> {
        let mut conn = self.pool.get().await.unwrap();
        audit_records::table
            .order(audit_records::id)
            .select(AuditRecord::as_select())
            .load(&mut conn)
            .await
            .unwrap()
    }

    pub async fn key_count(&self) -> i64 {
        let mut conn = self.pool.get().await.unwrap();
        idempotency_keys::table
            .count()
            .get_result(&mut conn)
            .await
            .unwrap()
    }

    /// The claim statements this app's CreateRides have sent so far, reads and writes counted apart.
    pub fn claim_statements_sent(&self) -> idempotency::ClaimStatementsSent {
        self.rides.claim_batcher().statement().sent()
    }

    /// Nothing was written by a rejected request.
    pub async fn assert_nothing_written(&self) {
        assert_eq!(
            self.key_count().await,
            0,
            "no idempotency key may be written"
        );
        assert!(self.rides().await.is_empty(), "no ride may be written");
        assert!(self.staged_jobs().await.is_empty(), "no job may be staged");
        assert!(
            self.audit_records().await.is_empty(),
            "no audit record may be written"
        );
        assert_eq!(
            self.stripe.create_calls(),
            0,
            "the provider must not be called"
        );
    }

    /// Claims a key the way a request's first step does: the key is born at `ride_created` with
    /// its ride, and left locked by the returned lease (an attempt that is about to charge, or
    /// that died holding the lock), so that its phase can be run by hand (`Rides::step`).
    pub async fn claim(&self, user: &TestUser, key: &str, params: &RideParams) -> Lease {
        let first_ride = self
            .rides
            .first_ride(*params, std::net::Ipv4Addr::LOCALHOST.into());
        let (_, claimed) = idempotency::claim(
            self.rides.claim_batcher(),
            Caller::Token(crate::auth::token_digest(&user.token)),
            &IdempotencyKey::parse(key).unwrap(),
            &params.signature(),
            &first_ride,
            self.rides.locking(),
            idempotency::Attempt {
                token: uuid::Uuid::new_v4(),
                expects_key: false,
            },
        )
        .await
        .unwrap()
        .expect("the user exists");
        match claimed.decision {
            Decision::Execute(lease) => lease,
            other => panic!("expected to own the key, got {other:?}"),
        }
    }

    /// Puts the key `lease` holds (just claimed, at `ride_created`) where an older server, one
    /// that committed the charge's record apart from finishing the key, could leave it, which
    /// this server never does: at
    /// `started` with no ride yet, or at `charge_created`, charged at the provider (the request
    /// this server makes, under the same idempotency key) and the charge recorded on the ride,
    /// with no receipt staged. The rows only: no older server's code runs.
    pub async fn leave_as_an_older_server(
        &self,
        lease: &mut Lease,
        request: &RideRequest,
        point: RecoveryPoint,
    ) {
        assert_eq!(lease.recovery_point, RecoveryPoint::RideCreated);
        let mut conn = self.pool.get().await.unwrap();
        let ride = rides::table
            .filter(rides::idempotency_key_id.eq(lease.key_id))
            .select(Ride::as_select())
            .first(&mut conn)
            .await
            .unwrap();
        let rows = match point {
            RecoveryPoint::Started => diesel::sql_query(
                "WITH audit AS (DELETE FROM audit_records WHERE resource_type = 'ride' \
                 AND resource_id = $1), gone AS (DELETE FROM rides WHERE id = $1 RETURNING id) \
                 UPDATE idempotency_keys SET recovery_point = 'started' FROM gone \
                 WHERE idempotency_keys.id = $2",
            )
            .bind::<diesel::sql_types::BigInt, _>(ride.id)
            .bind::<diesel::sql_types::BigInt, _>(lease.key_id)
            .execute(&mut conn)
            .await
            .unwrap(),
            RecoveryPoint::ChargeCreated => {
                let charge = crate::rides::charge_request(lease, request, &ride);
                let intent = self
                    .rides
                    .stripe()
                    .create_payment_intent(&charge)
                    .await
                    .unwrap();
                diesel::sql_query(
                    "WITH charged AS (UPDATE rides SET stripe_charge_id = $1 \
                     WHERE id = $2 RETURNING id) \
                     UPDATE idempotency_keys SET recovery_point = 'charge_created' FROM charged \
                     WHERE idempotency_keys.id = $3",
                )
                .bind::<diesel::sql_types::Text, _>(&intent.id)
                .bind::<diesel::sql_types::BigInt, _>(ride.id)
                .bind::<diesel::sql_types::BigInt, _>(lease.key_id)
                .execute(&mut conn)
                .await
                .unwrap()
            }
            other => {
                panic!("an older server's keys stop at started or charge_created, not {other}")
            }
        };
        assert_eq!(rows, 1);
        lease.recovery_point = point;
    }

    pub async fn rides_request(&self, user: &TestUser, params: RideParams) -> RideRequest {
        let mut conn = self.pool.get().await.unwrap();
        let user = users::table
            .find(user.id)
            .select(User::as_select())
            .first(&mut conn)
            .await
            .unwrap();
        RideRequest {
            user,
            params,
            origin_ip: std::net::Ipv4Addr::LOCALHOST.into(),
        }
    }

    /// Ages a key's lock past the lock timeout, as if its holder had died long ago.
    pub async fn expire_lock(&self, key_id: i64) {
        let mut conn = self.pool.get().await.unwrap();
        diesel::sql_query(
            "UPDATE idempotency_keys SET locked_at = now() - interval '1 hour' WHERE id = $1",
        )
        .bind::<diesel::sql_types::BigInt, _>(key_id)
        .execute(&mut conn)
        .await
        .unwrap();
    }
}

impl Drop for TestApp {
    fn drop(&mut self) {
        if let Some(shutdown) = self.shutdown.take() {
            let _ = shutdown.send(());
        }
        if let Some(server) = self.server.take() {
            server.abort();
        }
    }
}

pub fn ride_request() -> CreateRideRequest {
    CreateRideRequest {
        origin_lat: Some(37.7749),
        origin_lon: Some(-122.4194),
        target_lat: Some(37.3382),
        target_lon: Some(-121.8863),
    }
}

pub fn new_key() -> String {
    format!("test-key-{}", uuid::Uuid::new_v4())
}

pub fn authed<T>(token: &str, key: Option<&str>, body: T) -> Request<T> {
    let mut request = Request::new(body);
    request
        .metadata_mut()
        .insert("authorization", format!("Bearer {token}").parse().unwrap());
    if let Some(key) = key {
        request
            .metadata_mut()
            .insert(IDEMPOTENCY_KEY_HEADER, key.parse().unwrap());
    }
    request
}

pub fn replayed<T>(response: &Response<T>) -> bool {
    header(response.metadata(), REPLAYED_HEADER) == "true"
}

pub fn header(metadata: &tonic::metadata::MetadataMap, name: &str) -> String {
    metadata
        .get(name)
        .unwrap_or_else(|| panic!("missing {name} metadata"))
        .to_str()
        .unwrap()
        .to_owned()
}

pub fn expires_at(metadata: &tonic::metadata::MetadataMap) -> chrono::DateTime<chrono::Utc> {
    chrono::DateTime::parse_from_rfc3339(&header(metadata, EXPIRES_AT_HEADER))
        .unwrap()
        .to_utc()
}

/// Asserts the status code and the `ErrorInfo` reason of an error.
pub fn assert_status(status: &Status, code: Code, reason: &str) {
    assert_eq!(status.code(), code, "unexpected status: {status:?}");
    let details = status.get_error_details();
    let info = details
        .error_info()
        .unwrap_or_else(|| panic!("no ErrorInfo in {status:?}"));
    assert_eq!(info.reason, reason);
    assert_eq!(info.domain, crate::grpc::ERROR_DOMAIN);
}
