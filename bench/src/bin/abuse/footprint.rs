//! How much database work unauthenticated gRPC traffic causes, measured with nothing else
//! running: the legitimate clients are paused, each attack runs alone for a few seconds, and the
//! database's transaction count is read before and after, less what an idle window of the same
//! length counts (the campaign's own readings, the api-server's health checks).

use std::time::Duration;

use serde::Serialize;
use serde_json::Value;

use crate::{
    attacks::{
        Attack, Target,
        bad_tokens::{self, CALLERS, Tokens},
    },
    observe::Database,
    traffic::Phases,
};

const ALONE_SECS: u64 = 5;
/// A PostgreSQL backend that goes idle flushes its statistics within 10 s
/// (`PGSTAT_IDLE_INTERVAL`); readings wait this long so that every transaction is counted.
const FLUSH: Duration = Duration::from_secs(11);
/// Database noise a window may show beyond the idle one (a health check landing in one
/// window and not the other).
const NOISE: i64 = 2;

/// Unauthenticated traffic that reaches the gRPC services, and the transactions it may cause.
#[derive(Clone, Copy)]
enum Probe {
    Tokens(&'static str, Tokens, Allowed),
    BigMessages,
}

#[derive(Clone, Copy)]
enum Allowed {
    None,
    /// One lookup per caller whose call was in flight before the first answer was cached.
    FirstWave,
    /// Reported, not judged: a fresh well-shaped token costs one indexed read.
    Any,
}

const PROBES: [Probe; 4] = [
    Probe::Tokens("malformed tokens", Tokens::Malformed, Allowed::None),
    Probe::Tokens("one unknown token", Tokens::Repeated, Allowed::FirstWave),
    Probe::Tokens("random well-shaped tokens", Tokens::Random, Allowed::Any),
    Probe::BigMessages,
];

impl Probe {
    fn name(self) -> &'static str {
        match self {
            Probe::Tokens(name, ..) => name,
            Probe::BigMessages => "4 MiB messages",
        }
    }

    fn allowed(self) -> i64 {
        match self {
            Probe::Tokens(_, _, Allowed::Any) => i64::MAX,
            Probe::Tokens(_, _, Allowed::FirstWave) => CALLERS as i64 + NOISE,
            Probe::Tokens(_, _, Allowed::None) | Probe::BigMessages => NOISE,
        }
    }

    async fn run(self, target: &Target) -> anyhow::Result<Value> {
        match self {
            Probe::Tokens(_, tokens, _) => bad_tokens::run(target, tokens, None).await,
            Probe::BigMessages => Attack::BigMessages.run(target).await,
        }
    }
}

#[derive(Debug, Serialize)]
pub struct Footprint {
    pub traffic: &'static str,
    pub calls: Option<u64>,
    /// Transactions beyond an idle window's.
    pub transactions: i64,
    pub idle_transactions: i64,
    pub rows_written: i64,
    #[serde(skip)]
    allowed: i64,
}

async fn transactions_over(
    pool: &schema::Pool,
    legitimate: &[i64],
    work: impl Future<Output = anyhow::Result<Value>>,
) -> anyhow::Result<(Database, Value)> {
    let before = Database::read(pool, legitimate).await?;
    let report = work.await?;
    tokio::time::sleep(FLUSH).await;
    Ok((
        Database::read(pool, legitimate).await?.since(&before),
        report,
    ))
}

pub async fn measure(
    pool: &schema::Pool,
    legitimate: &[i64],
    phases: &Phases,
    target: &Target,
) -> anyhow::Result<Vec<Footprint>> {
    println!("abuse: database footprint of unauthenticated traffic (legitimate clients paused)");
    phases.pause(true);
    tokio::time::sleep(FLUSH).await;
    let idle = async {
        tokio::time::sleep(Duration::from_secs(ALONE_SECS)).await;
        Ok(Value::Null)
    };
    let (idle, _) = transactions_over(pool, legitimate, idle).await?;
    let alone = target.for_secs(ALONE_SECS);
    let mut footprints = Vec::new();
    for probe in PROBES {
        let (db, report) = transactions_over(pool, legitimate, probe.run(&alone)).await?;
        footprints.push(Footprint {
            traffic: probe.name(),
            allowed: probe.allowed(),
            calls: report.get("calls").and_then(Value::as_u64),
            transactions: db.transactions - idle.transactions,
            idle_transactions: idle.transactions,
            rows_written: db.attacker_keys + db.attacker_rides + db.attacker_audit_records,
        });
    }
    phases.pause(false);
    Ok(footprints)
}

/// Prints the footprints; whether they meet the goal: no rows from anyone, and no database work
/// but the lookups of well-shaped unknown tokens (each distinct one once, and the calls already
/// in flight when its first answer came). Random well-shaped tokens cost one indexed read each:
/// reported, not judged (docs/security.md).
pub fn print(footprints: &[Footprint]) -> bool {
    println!(
        "\n| unauthenticated, alone for {ALONE_SECS} s | calls attempted | DB transactions beyond idle | rows written |\n|---|---|---|---|"
    );
    let mut met = true;
    for f in footprints {
        let calls = f.calls.map_or_else(|| "-".to_owned(), |c| c.to_string());
        println!(
            "| {} | {calls} | {} | {} |",
            f.traffic, f.transactions, f.rows_written
        );
        if f.rows_written != 0 || f.transactions > f.allowed {
            met = false;
            println!("  MISSED: {} reached the database", f.traffic);
        }
    }
    met
}
