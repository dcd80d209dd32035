//! `workers admin …`: the operator CLI, for an on-call engineer working on production.
//!
//! Rules every command follows (see `docs/operations.md`):
//! - A command that changes state first works out *exactly* what it would change and prints it.
//!   Without `--yes` (or with the explicit `--dry-run`) it stops there: its database transaction
//!   is `READ ONLY` and nothing is ever published, acked or rejected for good.
//! - With `--yes` the same plan is recomputed inside one `READ COMMITTED` transaction that first
//!   locks the key row (`SELECT … FOR UPDATE`), so every precondition is re-checked against the
//!   row as it is at that moment, and the printed changes are the ones that were committed. The
//!   api-server's phases lock the same row first, so an operator's change and a phase never
//!   interleave. Waiting for that row lock is bounded (`lock_timeout` 5 s): a command never hangs
//!   behind a stuck transaction.
//! - A refused precondition exits non-zero with a message saying why and what to do.
//! - `--json` prints one JSON document on stdout (also for errors: `{"error": …}`); logs go to
//!   stderr. Lock tokens, API tokens and full e-mail addresses are never read or printed.
//!   Idempotency keys are printed in full (operators need them) but never logged.
//!
//! Each subcommand is a library function (used by the tests) returning a serialisable report;
//! [`run`] is the thin CLI layer that prints it.

mod broker;
mod change;
mod cli;

pub mod attention;
pub mod backlog;
pub mod dead_letters;
pub mod findings;
pub mod keys;
mod named_charge;
pub mod render;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{Pool, PoolError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{config::Config, topology::Topology};

pub use self::{
    broker::QueueDepth,
    change::{Change, ChangeReport},
    cli::{
        AdminArgs, AdminCommand, CommitArgs, DeadLettersCommand, FindingsCommand, FinishOutcome,
        KeyCommand, KeySelectorArgs, KeysCommand,
    },
};
pub(crate) use self::{
    broker::{close_channel, connect_broker, queue_depth},
    change::{change_transaction, check_note},
};

/// The settings the admin commands need, taken from the workers' [`Config`] (the same
/// environment variables as the fleet: `DATABASE_URL`, `AMQP_URL`, `AMQP_TOPOLOGY_PREFIX`,
/// `IDEMPOTENCY_LOCK_TIMEOUT_SECS`, `IDEMPOTENCY_KEY_TTL_HOURS` or `_SECS`).
#[derive(Clone, Debug)]
pub struct AdminSettings {
    /// When a lock may belong to an attempt that is still running.
    pub lock_rule: contract::key::LockRule,
    /// Key lifetime: `expires_at = created_at + key_ttl`.
    pub key_ttl: Duration,
    pub topology: Topology,
}

impl AdminSettings {
    pub fn from_config(config: &Config) -> AdminSettings {
        AdminSettings {
            lock_rule: config.reaper.lock_rule,
            key_ttl: config.reaper.key_ttl,
            topology: Topology::from_prefix(&config.topology_prefix, config.receipt_delivery_limit),
        }
    }
}

/// Whether a state-changing command only shows its plan or applies it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Mode {
    DryRun,
    Apply,
}

impl Mode {
    pub fn applies(self) -> bool {
        self == Mode::Apply
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AdminError {
    /// A precondition does not hold; nothing was changed.
    #[error("refused: {0}")]
    Refused(String),
    #[error("not found: {0}")]
    NotFound(String),
    #[error("invalid argument: {0}")]
    Invalid(String),
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error")]
    Database(#[from] diesel::result::Error),
    #[error("RabbitMQ error")]
    Broker(#[from] lapin::Error),
    #[error("RabbitMQ: {0}")]
    BrokerState(String),
    #[error("internal error: {0}")]
    Internal(String),
    #[error("payment provider")]
    Provider(#[from] provider::ProviderError),
    #[error(
        "interrupted; a transaction in progress was rolled back, unacked messages return to their queue"
    )]
    Interrupted,
}

impl AdminError {
    /// A stable name for `--json` consumers.
    pub fn kind(&self) -> &'static str {
        match self {
            AdminError::Refused(_) => "refused",
            AdminError::NotFound(_) => "not_found",
            AdminError::Invalid(_) => "invalid_argument",
            AdminError::Pool(_) => "database_unavailable",
            AdminError::Database(error) if is_lock_timeout(error) => "row_locked",
            AdminError::Database(_) => "database",
            AdminError::Broker(_) | AdminError::BrokerState(_) => "broker",
            AdminError::Internal(_) => "internal",
            AdminError::Provider(_) => "provider",
            AdminError::Interrupted => "interrupted",
        }
    }

    /// The message with every cause, on one line.
    pub fn describe(&self) -> String {
        if let AdminError::Database(error) = self
            && is_lock_timeout(error)
        {
            return "the row is locked by another transaction (an api-server phase or another \
                    operator) for more than 5 s; nothing was changed, try again"
                .to_owned();
        }
        error_chain(self)
    }
}

fn is_lock_timeout(error: &diesel::result::Error) -> bool {
    matches!(error, diesel::result::Error::DatabaseError(_, info)
        if info.message().starts_with("canceling statement due to lock timeout"))
}

pub(crate) use telemetry::error_chain;

/// Starts the statements of an applying transaction: never wait long for a row lock (a stuck
/// transaction must not hang the operator), never run long.
pub(crate) async fn bound_waits(conn: &mut AsyncPgConnection) -> Result<(), AdminError> {
    diesel::sql_query("SET LOCAL lock_timeout = '5s'")
        .execute(conn)
        .await?;
    diesel::sql_query("SET LOCAL statement_timeout = '30s'")
        .execute(conn)
        .await?;
    Ok(())
}

pub(crate) async fn db_now(conn: &mut AsyncPgConnection) -> Result<DateTime<Utc>, AdminError> {
    Ok(
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Timestamptz>("now()"))
            .get_result(conn)
            .await?,
    )
}

// ---------------------------------------------------------------------------------------------
// The command line.

/// What a command produced, ready to print.
pub enum Output {
    Key(Box<keys::KeyReport>),
    Change(ChangeReport),
    Attention(attention::AttentionList),
    DeadLetters(dead_letters::DeadLetterList),
    Requeue(dead_letters::RequeueReport),
    Backlog(backlog::Backlog),
    Findings(findings::FindingList),
    Finding(Box<findings::FindingReport>),
    Upgrade(keys::UpgradeReport),
}

impl Output {
    fn json(&self) -> serde_json::Result<String> {
        match self {
            Output::Key(report) => serde_json::to_string_pretty(report),
            Output::Change(report) => serde_json::to_string_pretty(report),
            Output::Attention(list) => serde_json::to_string_pretty(list),
            Output::DeadLetters(list) => serde_json::to_string_pretty(list),
            Output::Requeue(report) => serde_json::to_string_pretty(report),
            Output::Backlog(backlog) => serde_json::to_string_pretty(backlog),
            Output::Findings(list) => serde_json::to_string_pretty(list),
            Output::Finding(report) => serde_json::to_string_pretty(report),
            Output::Upgrade(report) => serde_json::to_string_pretty(report),
        }
    }

    fn text(&self) -> String {
        match self {
            Output::Key(report) => report.render(),
            Output::Change(report) => report.render(),
            Output::Attention(list) => list.render(),
            Output::DeadLetters(list) => list.render(),
            Output::Requeue(report) => report.render(),
            Output::Backlog(backlog) => backlog.render(),
            Output::Findings(list) => list.render(),
            Output::Finding(report) => report.render(),
            Output::Upgrade(report) => report.render(),
        }
    }

    /// A command can print a complete report and still fail (a requeue that stopped part-way,
    /// a backlog whose broker half is unreachable).
    fn failure(&self) -> Option<String> {
        match self {
            Output::Requeue(report) => report.stopped.clone(),
            Output::Backlog(backlog) => backlog.queues_error.clone(),
            Output::Upgrade(report) => report.failure(),
            _ => None,
        }
    }
}

/// Runs one admin command against the environment's database and broker, and prints its report
/// on stdout (text, or JSON with `--json`). Errors are printed too (as JSON on stdout with
/// `--json`), then returned so that the process exits non-zero.
pub async fn run(
    args: AdminArgs,
    config: &Config,
    shutdown: CancellationToken,
) -> anyhow::Result<()> {
    let settings = AdminSettings::from_config(config);
    // Two connections at most: an operator's tool must not take a share of production's pool.
    let pool = schema::build_pool(
        config.database_url.expose(),
        2,
        Duration::from_secs(10),
        schema::PlanCache::Auto,
    );
    let amqp_url = config.amqp_url.expose();
    let json = args.json;
    let result = tokio::select! {
        result = dispatch(args.command, &pool, amqp_url, &settings, &config.reconciler.stripe) => result,
        // Dropping the future rolls back an open transaction (the connection is discarded) and
        // closes the broker connection, which returns unacked messages to their queue.
        () = shutdown.cancelled() => Err(AdminError::Interrupted),
    };
    match result {
        Ok(output) => {
            if json {
                println!("{}", output.json()?);
            } else {
                print!("{}", output.text());
            }
            match output.failure() {
                Some(failure) => Err(anyhow::anyhow!(failure)),
                None => Ok(()),
            }
        }
        Err(error) => {
            let message = error.describe();
            if json {
                println!(
                    "{}",
                    serde_json::json!({ "error": error.kind(), "message": message })
                );
            }
            Err(anyhow::anyhow!(message))
        }
    }
}

/// `stripe` is only used by `findings refund`, `key finish` and `keys upgrade`: the provider's
/// client is built for them alone.
async fn dispatch(
    command: AdminCommand,
    pool: &Pool,
    amqp_url: &str,
    settings: &AdminSettings,
    stripe: &provider::StripeConfig,
) -> Result<Output, AdminError> {
    Ok(match command {
        AdminCommand::Key(KeyCommand::Show(selector)) => {
            let selector = keys::KeySelector::try_from(selector)?;
            Output::Key(Box::new(keys::show(pool, settings, &selector).await?))
        }
        AdminCommand::Key(KeyCommand::Unlock {
            key_id,
            force,
            commit,
        }) => Output::Change(keys::unlock(pool, settings, key_id, force, commit.mode()).await?),
        AdminCommand::Key(KeyCommand::Finish {
            key_id,
            outcome,
            charge_id,
            message,
            force,
            commit,
        }) => {
            let request = keys::FinishRequest {
                key_id,
                outcome,
                charge_id,
                message,
                force,
            };
            let stripe = stripe_client(stripe)?;
            Output::Change(keys::finish(pool, settings, &stripe, &request, commit.mode()).await?)
        }
        AdminCommand::Keys(KeysCommand::NeedingAttention { all, limit }) => {
            Output::Attention(attention::list(pool, all, limit).await?)
        }
        AdminCommand::Keys(KeysCommand::Upgrade { commit }) => {
            let stripe = stripe_client(stripe)?;
            Output::Upgrade(keys::upgrade(pool, settings, &stripe, commit.mode()).await?)
        }
        AdminCommand::Keys(KeysCommand::Resolve { id, note, commit }) => {
            Output::Change(attention::resolve(pool, id, note.as_deref(), commit.mode()).await?)
        }
        AdminCommand::DeadLetters(DeadLettersCommand::List { limit }) => {
            Output::DeadLetters(dead_letters::list(amqp_url, &settings.topology, limit).await?)
        }
        AdminCommand::DeadLetters(DeadLettersCommand::Requeue { limit, commit }) => {
            Output::Requeue(
                dead_letters::requeue(amqp_url, &settings.topology, limit, commit.mode()).await?,
            )
        }
        AdminCommand::Backlog => {
            Output::Backlog(backlog::backlog(pool, amqp_url, &settings.topology).await?)
        }
        AdminCommand::Findings(FindingsCommand::List { all, limit }) => {
            Output::Findings(findings::list(pool, all, limit).await?)
        }
        AdminCommand::Findings(FindingsCommand::Show { id }) => {
            Output::Finding(Box::new(findings::show(pool, id).await?))
        }
        AdminCommand::Findings(FindingsCommand::Resolve { id, note, commit }) => {
            Output::Change(findings::resolve(pool, id, &note, commit.mode()).await?)
        }
        AdminCommand::Findings(FindingsCommand::Refund {
            id,
            operator,
            commit,
        }) => {
            use crate::reconciler::refund::{RefundRequester, refund_finding};
            let requester = RefundRequester::operator(&operator)?;
            let stripe = stripe_client(stripe)?;
            Output::Change(refund_finding(pool, &stripe, id, commit.mode(), &requester).await?)
        }
    })
}

fn stripe_client(stripe: &provider::StripeConfig) -> Result<provider::StripeClient, AdminError> {
    provider::StripeClient::new(stripe).map_err(|error| {
        AdminError::Internal(format!(
            "cannot build the payment provider's client: {error}"
        ))
    })
}
