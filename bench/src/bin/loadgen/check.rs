//! The end-of-run check: the database and the provider's ledger against the keys that succeeded.

use std::{collections::HashMap, sync::Arc};

use anyhow::Context;
use diesel::{
    QueryableByName,
    sql_types::{Array, BigInt},
};
use diesel_async::RunQueryDsl;
use futures_util::{StreamExt, TryStreamExt};
use serde_json::json;

use crate::{
    args::Args,
    clients::{BenchUser, ClientStats},
};

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    n: i64,
}

/// Rides, charged rides, finished keys, staged jobs and provider PaymentIntents of this run's
/// users must each equal the number of keys that succeeded.
pub(crate) async fn check(
    args: &Args,
    users: &[Arc<BenchUser>],
    total: &ClientStats,
) -> anyhow::Result<(bool, serde_json::Value)> {
    let expected = i64::try_from(total.new_keys_ok)?;
    let ids: Vec<i64> = users.iter().map(|u| u.id).collect();
    let mut conn = schema::connect(&args.database_url).await?;
    let mut count = async |sql: &str| -> anyhow::Result<i64> {
        let row: Count = diesel::sql_query(sql)
            .bind::<Array<BigInt>, _>(&ids)
            .get_result(&mut conn)
            .await
            .with_context(|| format!("check query failed: {sql}"))?;
        Ok(row.n)
    };
    let rides = count("SELECT count(*) AS n FROM rides WHERE user_id = ANY($1)").await?;
    let charged = count(
        "SELECT count(*) AS n FROM rides WHERE user_id = ANY($1) AND stripe_charge_id IS NOT NULL",
    )
    .await?;
    let finished = count(
        "SELECT count(*) AS n FROM idempotency_keys WHERE user_id = ANY($1) AND recovery_point = 'finished'",
    )
    .await?;
    let staged = count(
        "SELECT count(*) AS n FROM staged_jobs WHERE (job_args->>'user_id')::bigint = ANY($1)",
    )
    .await?;
    let ledger = ledger_count(args, users).await?;
    let pass = [rides, charged, finished, staged, ledger]
        .iter()
        .all(|n| *n == expected);
    println!(
        "check: succeeded keys {expected}; rides {rides}, charged rides {charged}, finished keys {finished}, \
         staged jobs {staged}, fake-stripe PaymentIntents {ledger} -> {}",
        if pass { "PASS" } else { "FAIL" }
    );
    Ok((
        pass,
        json!({
            "expected": expected, "rides": rides, "charged_rides": charged,
            "finished_keys": finished, "staged_jobs": staged, "payment_intents": ledger,
        }),
    ))
}

/// PaymentIntents of this run's customers, paginated 100 at a time; 8 customers at once (a
/// rider pool has 10,000).
async fn ledger_count(args: &Args, users: &[Arc<BenchUser>]) -> anyhow::Result<i64> {
    let http = reqwest::Client::new();
    let counts: Vec<i64> = futures_util::stream::iter(users)
        .map(|user| customer_intents(args, &http, &user.customer))
        .buffer_unordered(8)
        .try_collect()
        .await?;
    Ok(counts.iter().sum())
}

async fn customer_intents(
    args: &Args,
    http: &reqwest::Client,
    customer: &str,
) -> anyhow::Result<i64> {
    let mut total = 0_i64;
    let mut starting_after: Option<String> = None;
    for _page in 0..100_000 {
        let mut query: Vec<(&str, String)> = vec![
            ("limit", "100".to_owned()),
            ("customer", customer.to_owned()),
        ];
        if let Some(after) = &starting_after {
            query.push(("starting_after", after.clone()));
        }
        let page: HashMap<String, serde_json::Value> = http
            .get(format!("{}/v1/payment_intents", args.stripe_base))
            .bearer_auth(&args.stripe_key)
            .query(&query)
            .send()
            .await?
            .error_for_status()?
            .json()
            .await?;
        let data = page
            .get("data")
            .and_then(|d| d.as_array())
            .context("payment_intents list without data")?;
        total += i64::try_from(data.len())?;
        let has_more = page
            .get("has_more")
            .and_then(serde_json::Value::as_bool)
            .unwrap_or(false);
        starting_after = data
            .last()
            .and_then(|pi| pi.get("id"))
            .and_then(|id| id.as_str())
            .map(str::to_owned);
        if !has_more || starting_after.is_none() {
            break;
        }
    }
    Ok(total)
}
