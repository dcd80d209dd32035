//! `workers admin …` against real PostgreSQL (TestApp: the api-server over gRPC, fake-stripe)
//! and real RabbitMQ (a private topology per test). The library functions the CLI dispatches to
//! are called directly; one test runs the compiled binary end to end. The helpers every command's
//! tests share (settings, a key left at a recovery point, the attention list, `keys show` and
//! `keys finish` as the operator runs them) live here; each command's tests in a module of its own.

mod binary;
mod key_finish;
mod key_show;
mod key_unlock;
mod key_upgrade;
mod queues;

use std::time::Duration;

use api_server::{
    idempotency::Lease,
    rides::RideParams,
    testing::{TestApp, TestUser, new_key},
};
use diesel::{QueryDsl, SelectableHelper};
use diesel_async::RunQueryDsl;
use schema::{
    RecoveryPoint,
    models::{KeyNeedingAttention, NewKeyNeedingAttention},
    schema::keys_needing_attention,
};
use workers::{
    admin::{
        AdminError, AdminSettings, FinishOutcome, Mode,
        keys::{self, FinishRequest, KeySelector},
    },
    topology::Topology,
};

fn settings(topology: Topology) -> AdminSettings {
    AdminSettings {
        lock_rule: contract::key::LockRule::new(
            Duration::from_secs(90),
            Duration::from_secs(86_400),
        ),
        key_ttl: Duration::from_secs(72 * 3600),
        topology,
    }
}

fn db_settings() -> AdminSettings {
    settings(Topology::from_prefix("admin-tests-no-broker", 5))
}

/// The parameters of `ride_request()`, so that a gRPC retry with it replays the key.
fn params() -> RideParams {
    RideParams::new(
        Some(37.7749),
        Some(-122.4194),
        Some(37.3382),
        Some(-121.8863),
    )
    .unwrap()
}

/// A key whose attempt stopped at `point`, still holding its (live) lock: at `ride_created` as
/// this server's attempts stop, at `started` or `charge_created` as only an older server left keys
/// (`TestApp::leave_as_an_older_server`).
async fn key_at(app: &TestApp, user: &TestUser, point: RecoveryPoint) -> (String, Lease) {
    let key = new_key();
    let mut lease = app.claim(user, &key, &params()).await;
    if point != RecoveryPoint::RideCreated {
        let request = app.rides_request(user, params()).await;
        app.leave_as_an_older_server(&mut lease, &request, point)
            .await;
    }
    (key, lease)
}

/// A key abandoned at `point`: its attempt died long ago, the lock has expired.
async fn abandoned_at(app: &TestApp, user: &TestUser, point: RecoveryPoint) -> (String, i64) {
    let (key, lease) = key_at(app, user, point).await;
    app.expire_lock(lease.key_id).await;
    (key, lease.key_id)
}

async fn record_attention(app: &TestApp, user: &TestUser, key: &str, key_id: i64) -> i64 {
    let mut conn = app.pool.get().await.unwrap();
    let request_params = params().signature().params.to_value();
    diesel::insert_into(keys_needing_attention::table)
        .values(NewKeyNeedingAttention {
            reason: "completer_gave_up",
            idempotency_key_id: key_id,
            user_id: user.id,
            idempotency_key: key,
            recovery_point: RecoveryPoint::RideCreated,
            request_params: &request_params,
            last_error: Some("UNAVAILABLE: payment provider unavailable"),
        })
        .returning(keys_needing_attention::id)
        .get_result(&mut conn)
        .await
        .unwrap()
}

async fn sql(app: &TestApp, statement: &str) {
    let mut conn = app.pool.get().await.unwrap();
    diesel::sql_query(statement)
        .execute(&mut conn)
        .await
        .unwrap();
}

async fn attention_rows(app: &TestApp) -> Vec<KeyNeedingAttention> {
    let mut conn = app.pool.get().await.unwrap();
    keys_needing_attention::table
        .order(keys_needing_attention::id)
        .select(KeyNeedingAttention::as_select())
        .load(&mut conn)
        .await
        .unwrap()
}

async fn show(app: &TestApp, key_id: i64) -> keys::KeyReport {
    keys::show(&app.pool, &db_settings(), &KeySelector::Id(key_id))
        .await
        .unwrap()
}

/// The provider's client `key finish` checks a `--charge-id` with.
fn stripe(app: &TestApp) -> provider::StripeClient {
    provider::StripeClient::new(&provider::StripeConfig {
        api_base: app.stripe.base_url(),
        secret_key: provider::Secret::new("sk_test_harness"),
        timeout: Duration::from_secs(5),
        idempotency_window: Duration::from_secs(86_400),
        deployment_id: app.config.stripe.deployment_id.clone(),
    })
    .unwrap()
}

async fn finish(
    app: &TestApp,
    request: &FinishRequest,
    mode: Mode,
) -> Result<workers::admin::ChangeReport, AdminError> {
    keys::finish(&app.pool, &db_settings(), &stripe(app), request, mode).await
}

fn finish_request(key_id: i64, outcome: FinishOutcome) -> FinishRequest {
    FinishRequest {
        key_id,
        outcome,
        charge_id: None,
        message: None,
        force: false,
    }
}

fn assert_refused<T: std::fmt::Debug>(result: Result<T, AdminError>, needle: &str) {
    match result {
        Err(AdminError::Refused(message)) => {
            assert!(message.contains(needle), "{needle:?} not in {message:?}")
        }
        other => panic!("expected a refusal mentioning {needle:?}, got {other:?}"),
    }
}
