//! The evidence the invariants are checked against, read once the system is drained: the
//! database's rows (keys, rides, receipts, staged jobs, keys needing attention), the provider's
//! ledger from fake-stripe, and the mails the sink wrote. The three are read independently, so
//! that each can contradict the others.

use std::{
    collections::{BTreeMap, HashMap, HashSet},
    path::Path,
};

use anyhow::{Context, bail};
use diesel::{
    QueryableByName,
    sql_types::{BigInt, Bool, Nullable, Text},
};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use serde_json::Value;

use crate::{
    reconciliation::{Reconciliation, reconcile},
    setup::{Plan, STRIPE_KEY, Wiring},
};

#[derive(QueryableByName, Debug)]
pub(crate) struct KeyRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) idempotency_key: String,
    #[diesel(sql_type = BigInt)]
    pub(crate) user_id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) recovery_point: String,
    #[diesel(sql_type = Bool)]
    pub(crate) gave_up: bool,
    /// The stored outcome's kind (`response_body->>'outcome'`), once finished.
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) outcome: Option<String>,
}

#[derive(QueryableByName, Debug)]
pub(crate) struct RideRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) id: i64,
    #[diesel(sql_type = Nullable<BigInt>)]
    pub(crate) idempotency_key_id: Option<i64>,
    #[diesel(sql_type = BigInt)]
    pub(crate) user_id: i64,
    #[diesel(sql_type = Nullable<Text>)]
    pub(crate) stripe_charge_id: Option<String>,
}

#[derive(QueryableByName, Debug)]
struct IdRow {
    #[diesel(sql_type = BigInt)]
    id: i64,
}

#[derive(QueryableByName, Debug)]
struct TextRow {
    #[diesel(sql_type = Text)]
    t: String,
}

#[derive(QueryableByName, Debug)]
pub(crate) struct AttentionRow {
    #[diesel(sql_type = BigInt)]
    pub(crate) idempotency_key_id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) idempotency_key: String,
    #[diesel(sql_type = BigInt)]
    pub(crate) user_id: i64,
    #[diesel(sql_type = Text)]
    pub(crate) reason: String,
}

#[derive(QueryableByName, Debug)]
struct CountRow {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

pub(crate) async fn count(conn: &mut AsyncPgConnection, sql: &str) -> anyhow::Result<i64> {
    Ok(diesel::sql_query(sql)
        .get_result::<CountRow>(conn)
        .await
        .with_context(|| sql.to_owned())?
        .n)
}

pub(crate) struct Intent {
    pub(crate) id: String,
    pub(crate) status: String,
    pub(crate) ride_id: Option<i64>,
}

/// A PaymentIntent of the other product on the account ([`crate::other_product`]).
pub(crate) struct ForeignIntent {
    pub(crate) id: String,
    pub(crate) variant: String,
}

/// Every object of a fake-stripe list (`path`: `/v1/payment_intents`, `/v1/refunds`), page by
/// page.
pub(crate) async fn fetch_list(
    http: &reqwest::Client,
    base: &str,
    path: &str,
) -> anyhow::Result<Vec<Value>> {
    let mut out: Vec<Value> = Vec::new();
    for _page in 0..100_000 {
        let mut url = format!("{base}{path}?limit=100");
        if let Some(a) = out.last().and_then(|last| last["id"].as_str()) {
            url.push_str(&format!("&starting_after={a}"));
        }
        let body: Value = http
            .get(&url)
            .bearer_auth(STRIPE_KEY)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let data = body["data"].as_array().cloned().unwrap_or_default();
        let done = !body["has_more"].as_bool().unwrap_or(false) || data.is_empty();
        out.extend(data);
        if done {
            return Ok(out);
        }
    }
    bail!("{path} pagination did not end")
}

/// Every PaymentIntent fake-stripe holds: ours (or claiming to be), and the other product's.
async fn fetch_ledger(
    http: &reqwest::Client,
    base: &str,
) -> anyhow::Result<(Vec<Intent>, Vec<ForeignIntent>)> {
    let (mut ours, mut foreign) = (Vec::new(), Vec::new());
    for pi in fetch_list(http, base, "/v1/payment_intents").await? {
        let id = pi["id"].as_str().unwrap_or_default().to_owned();
        if pi["metadata"]["proof_product"].as_str() == Some(crate::other_product::TAG) {
            let variant = pi["metadata"]["proof_variant"].as_str().unwrap_or("?");
            foreign.push(ForeignIntent {
                id,
                variant: variant.to_owned(),
            });
            continue;
        }
        ours.push(Intent {
            id,
            status: pi["status"].as_str().unwrap_or_default().to_owned(),
            ride_id: pi["metadata"]["ride_id"]
                .as_str()
                .and_then(|s| s.parse().ok()),
        });
    }
    Ok((ours, foreign))
}

/// ride id → the nanosecond stamps of the .eml files carrying `<ride-N.receipt@…>`.
pub(crate) fn read_mail(dir: &Path) -> anyhow::Result<(BTreeMap<i64, Vec<i128>>, u64)> {
    let mut by_ride: BTreeMap<i64, Vec<i128>> = BTreeMap::new();
    let mut unparsed = 0;
    for entry in std::fs::read_dir(dir)? {
        let path = entry?.path();
        if path.extension().and_then(|e| e.to_str()) != Some("eml") {
            continue;
        }
        let stamp: i128 = path
            .file_name()
            .and_then(|n| n.to_str())
            .and_then(|n| n.split('-').next())
            .and_then(|s| s.parse().ok())
            .unwrap_or_default();
        let text = std::fs::read_to_string(&path).unwrap_or_default();
        let ride = text
            .lines()
            .find(|l| l.to_ascii_lowercase().starts_with("message-id:"))
            .and_then(|l| l.split("<ride-").nth(1))
            .and_then(|rest| rest.split(".receipt@").next())
            .and_then(|n| n.parse::<i64>().ok());
        match ride {
            Some(ride) => by_ride.entry(ride).or_default().push(stamp),
            None => unparsed += 1,
        }
    }
    Ok((by_ride, unparsed))
}

/// The idempotency keys, read before the replays (which look up each finished key).
pub(crate) async fn load_keys(conn: &mut AsyncPgConnection) -> anyhow::Result<Vec<KeyRow>> {
    Ok(diesel::sql_query(
        "SELECT id, idempotency_key, user_id, recovery_point, \
         completer_gave_up_at IS NOT NULL AS gave_up, response_body->>'outcome' AS outcome \
         FROM idempotency_keys",
    )
    .load(conn)
    .await?)
}

/// The key rows by (user, key), as a client knows its keys.
pub(crate) fn by_name(keys: &[KeyRow]) -> HashMap<(i64, String), &KeyRow> {
    keys.iter()
        .map(|k| ((k.user_id, k.idempotency_key.clone()), k))
        .collect()
}

pub(crate) struct Evidence {
    pub(crate) keys: Vec<KeyRow>,
    pub(crate) rides: Vec<RideRow>,
    pub(crate) sent_receipts: HashSet<i64>,
    /// Receipts whose sending attempt died after the relay took the mail: the crash window, closed.
    pub(crate) recovered_at_relay: i64,
    pub(crate) claims_left: i64,
    /// The ride of each receipt job still staged.
    pub(crate) staged_rides: Vec<i64>,
    pub(crate) attention: Vec<AttentionRow>,
    pub(crate) attention_keys: HashSet<(i64, String)>,
    pub(crate) ledger: Vec<Intent>,
    /// The other product's PaymentIntents, kept out of `ledger`.
    pub(crate) foreign: Vec<ForeignIntent>,
    /// What a reconciler pass over the whole run found.
    pub(crate) reconciliation: Reconciliation,
    /// ride id → the stamps of its mails.
    pub(crate) mail: BTreeMap<i64, Vec<i128>>,
    pub(crate) unparsed_mail: u64,
}

/// Collect the evidence.
pub(crate) async fn collect(
    conn: &mut AsyncPgConnection,
    keys: Vec<KeyRow>,
    http: &reqwest::Client,
    plan: &Plan,
    wiring: &Wiring,
) -> anyhow::Result<Evidence> {
    let rides: Vec<RideRow> =
        diesel::sql_query("SELECT id, idempotency_key_id, user_id, stripe_charge_id FROM rides")
            .load(conn)
            .await?;
    let sent_receipts: HashSet<i64> = diesel::sql_query("SELECT ride_id AS id FROM sent_receipts")
        .load::<IdRow>(conn)
        .await?
        .into_iter()
        .map(|r| r.id)
        .collect();
    let recovered_at_relay = count(
        conn,
        "SELECT count(*) AS n FROM sent_receipts WHERE recorded_via = 'relay_search'",
    )
    .await?;
    let claims_left = count(conn, "SELECT count(*) AS n FROM receipt_claims").await?;
    let staged_rides: Vec<i64> = diesel::sql_query("SELECT job_args::text AS t FROM staged_jobs")
        .load::<TextRow>(conn)
        .await?
        .into_iter()
        .filter_map(|r| serde_json::from_str::<Value>(&r.t).ok())
        .filter_map(|v| v["ride_id"].as_i64())
        .collect();
    let attention: Vec<AttentionRow> = diesel::sql_query(
        "SELECT idempotency_key_id, idempotency_key, user_id, reason FROM keys_needing_attention",
    )
    .load(conn)
    .await?;
    let attention_keys: HashSet<(i64, String)> = attention
        .iter()
        .map(|a| (a.user_id, a.idempotency_key.clone()))
        .collect();
    let (ledger, foreign) = fetch_ledger(http, &wiring.stripe_base).await?;
    let reconciliation = reconcile(conn, plan, wiring).await?;
    let (mail, unparsed_mail) = read_mail(&plan.mail_dir)?;
    Ok(Evidence {
        keys,
        rides,
        sent_receipts,
        recovered_at_relay,
        claims_left,
        staged_rides,
        attention,
        attention_keys,
        ledger,
        foreign,
        reconciliation,
        mail,
        unparsed_mail,
    })
}
