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

use std::fmt::Write as _;

pub mod attention;
pub mod backlog;
pub mod dead_letters;
pub mod findings;
pub mod keys;
mod named_charge;
pub mod render;

use std::time::Duration;

use chrono::{DateTime, Utc};
use clap::{Args, Subcommand, ValueEnum};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use lapin::{Channel, Connection};
use schema::{Pool, PoolError};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{config::Config, topology::Topology};

/// The settings the admin commands need, taken from the workers' [`Config`] (the same
/// environment variables as the fleet: `DATABASE_URL`, `AMQP_URL`, `AMQP_TOPOLOGY_PREFIX`,
/// `IDEMPOTENCY_LOCK_TIMEOUT_SECS`, `IDEMPOTENCY_KEY_TTL_HOURS`).
#[derive(Clone, Debug)]
pub struct AdminSettings {
    /// A lock younger than this may belong to an attempt that is still running.
    pub lock_timeout: Duration,
    /// Key lifetime: `expires_at = created_at + key_ttl`.
    pub key_ttl: Duration,
    pub topology: Topology,
}

impl AdminSettings {
    pub fn from_config(config: &Config) -> AdminSettings {
        AdminSettings {
            lock_timeout: config.reaper.lock_timeout,
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

/// One change a command makes (or would make), as printed before it is applied.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Change {
    /// `update` or `insert`.
    pub action: &'static str,
    pub table: &'static str,
    /// The row's id; `None` for a row that is yet to be inserted.
    pub row: Option<i64>,
    /// The column updated; `None` for an insert.
    pub column: Option<&'static str>,
    pub from: Option<serde_json::Value>,
    pub to: serde_json::Value,
}

impl Change {
    pub fn update(
        table: &'static str,
        row: i64,
        column: &'static str,
        from: serde_json::Value,
        to: serde_json::Value,
    ) -> Change {
        Change {
            action: "update",
            table,
            row: Some(row),
            column: Some(column),
            from: Some(from),
            to,
        }
    }

    pub fn insert(table: &'static str, values: serde_json::Value) -> Change {
        Change {
            action: "insert",
            table,
            row: None,
            column: None,
            from: None,
            to: values,
        }
    }
}

/// What a state-changing database command did or would do.
#[derive(Clone, Debug, Serialize)]
pub struct ChangeReport {
    pub command: &'static str,
    pub mode: Mode,
    /// The row the command is about (key id, or attention row id).
    pub target: i64,
    pub changes: Vec<Change>,
    pub warnings: Vec<String>,
    /// Facts the operator should see next to the changes (the outcome a replay will return, …).
    pub notes: Vec<String>,
}

impl ChangeReport {
    pub fn new(command: &'static str, mode: Mode, target: i64) -> ChangeReport {
        ChangeReport {
            command,
            mode,
            target,
            changes: Vec::new(),
            warnings: Vec::new(),
            notes: Vec::new(),
        }
    }
}

/// The transaction a change runs in: READ COMMITTED, and read-only for a dry run, so that a
/// dry run can take no lock and write nothing whatever its statements are.
pub(crate) fn change_transaction(
    conn: &mut AsyncPgConnection,
    mode: Mode,
) -> diesel_async::pg::TransactionBuilder<'_, AsyncPgConnection> {
    let transaction = conn.build_transaction().read_committed();
    if mode.applies() {
        transaction
    } else {
        transaction.read_only()
    }
}

/// An operator's resolution note: 1 to 2000 characters, not only blanks.
pub(crate) fn check_note(note: &str) -> Result<(), AdminError> {
    if note.trim().is_empty() || note.chars().count() > 2000 {
        return Err(AdminError::Invalid(
            "--note must be 1 to 2000 characters".into(),
        ));
    }
    Ok(())
}

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

/// Opens an AMQP connection without declaring anything: an operator's command must not create
/// or alter topology in production (a declaration with different arguments would even be
/// refused). Queues are checked with passive declarations instead.
pub(crate) async fn connect_broker(amqp_url: &str) -> Result<Connection, AdminError> {
    Ok(crate::amqp::connect(amqp_url).await?)
}

/// The message and consumer counts of a queue (a passive declare, on a channel of its own: a
/// failed passive declare closes its channel). A missing queue is an error.
pub(crate) async fn queue_depth(
    connection: &Connection,
    queue: &str,
) -> Result<QueueDepth, AdminError> {
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            queue.into(),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..lapin::options::QueueDeclareOptions::default()
            },
            lapin::types::FieldTable::default(),
        )
        .await;
    let declared = match declared {
        Ok(declared) => {
            close_channel(&channel).await;
            declared
        }
        Err(error) => {
            return Err(AdminError::BrokerState(format!(
                "queue {queue:?} cannot be inspected (does it exist? is AMQP_TOPOLOGY_PREFIX \
                 right?): {error}"
            )));
        }
    };
    Ok(QueueDepth {
        queue: queue.to_owned(),
        messages: declared.message_count(),
        consumers: declared.consumer_count(),
    })
}

/// Closes a channel and waits for the broker's answer, so that closing the connection next does
/// not race it. Errors are irrelevant: the channel is done with.
pub(crate) async fn close_channel(channel: &Channel) {
    if channel.status().connected() {
        let _ = channel.close(200, "bye".into()).await;
    }
}

#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct QueueDepth {
    pub queue: String,
    pub messages: u32,
    pub consumers: u32,
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

/// `workers admin …`
#[derive(Args, Debug)]
pub struct AdminArgs {
    /// Print one machine-readable JSON document on stdout instead of text.
    #[arg(long, global = true)]
    pub json: bool,
    #[command(subcommand)]
    pub command: AdminCommand,
}

#[derive(Subcommand, Debug)]
pub enum AdminCommand {
    /// Inspect or repair one idempotency key.
    #[command(subcommand)]
    Key(KeyCommand),
    /// Keys that automation could not finish (`keys_needing_attention`).
    #[command(subcommand)]
    Keys(KeysCommand),
    /// Receipt messages in the dead-letter queue.
    #[command(subcommand, name = "dead-letters")]
    DeadLetters(DeadLettersCommand),
    /// Staged jobs not yet published, and the receipts and dead-letter queue depths.
    Backlog,
    /// What the reconciler found: the provider's charges and the rides disagree.
    #[command(subcommand)]
    Findings(FindingsCommand),
}

#[derive(Subcommand, Debug)]
pub enum FindingsCommand {
    /// Lists open reconciliation findings, oldest first.
    List {
        /// Include resolved findings.
        #[arg(long)]
        all: bool,
        /// Show at most this many (the total is always reported).
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Everything recorded about one finding.
    Show {
        /// The finding's id (as `findings list` prints it).
        id: i64,
    },
    /// Marks a finding settled, with the reason (kept in `resolution`).
    Resolve {
        /// The finding's id.
        id: i64,
        /// Why it is settled (what was done, or why nothing needs doing).
        #[arg(long)]
        note: String,
        #[command(flatten)]
        commit: CommitArgs,
    },
    /// Refunds the charge of an unrecorded_charge finding at the provider (once, however often
    /// it is run), once it is proven ours again, and resolves the finding; the refund is audited
    /// (`refund_audits`) with who approved it. Not subject to the reconciler's per-pass caps: each
    /// is one person's approval.
    Refund {
        /// The finding's id.
        id: i64,
        /// Who approves this refund (recorded in the audit as `operator:<name>`).
        #[arg(long)]
        operator: String,
        #[command(flatten)]
        commit: CommitArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum KeyCommand {
    /// Everything known about a key: state, lock, completer, stored outcome, ride, attention.
    Show(KeySelectorArgs),
    /// Clears the lock of an unfinished key so that a retry or the completer resumes it.
    Unlock {
        /// The key's row id (idempotency_keys.id, as `key show` prints it).
        #[arg(long)]
        key_id: i64,
        /// Also unlock a live lock (younger than IDEMPOTENCY_LOCK_TIMEOUT_SECS) whose holder may
        /// still be running.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        commit: CommitArgs,
    },
    /// Marks a stuck key finished with a stated outcome, as the api-server would have stored it.
    Finish {
        /// The key's row id (idempotency_keys.id, as `key show` prints it).
        #[arg(long)]
        key_id: i64,
        /// The outcome a client's replay returns from now on.
        #[arg(long, value_enum)]
        outcome: FinishOutcome,
        /// The PaymentIntent (pi_…) found at the provider; required for `succeeded` when the
        /// ride has no charge id recorded.
        #[arg(long)]
        charge_id: Option<String>,
        /// The decline message a replay returns (`declined` only).
        #[arg(long)]
        message: Option<String>,
        /// Also finish a key whose lock is live (its holder may still be running).
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        commit: CommitArgs,
    },
}

#[derive(Args, Debug)]
#[group(required = true, multiple = true)]
pub struct KeySelectorArgs {
    /// The key's row id (idempotency_keys.id).
    #[arg(long, conflicts_with_all = ["user_id", "key"])]
    pub key_id: Option<i64>,
    /// With --key: the user the key belongs to.
    #[arg(long, requires = "key")]
    pub user_id: Option<i64>,
    /// With --user-id: the idempotency key string the client sent.
    #[arg(long, requires = "user_id")]
    pub key: Option<String>,
}

#[derive(Subcommand, Debug)]
pub enum KeysCommand {
    /// Lists unresolved keys_needing_attention rows, oldest first.
    NeedingAttention {
        /// Include resolved rows.
        #[arg(long)]
        all: bool,
        /// Show at most this many rows (the total is always reported).
        #[arg(long, default_value_t = 100)]
        limit: i64,
    },
    /// Marks one keys_needing_attention row resolved (resolved_at = now()).
    Resolve {
        /// The keys_needing_attention row id (as `keys needing-attention` prints it).
        #[arg(long)]
        id: i64,
        /// Why it is resolved; printed and logged (the table has no column for it).
        #[arg(long)]
        note: Option<String>,
        #[command(flatten)]
        commit: CommitArgs,
    },
}

#[derive(Subcommand, Debug)]
pub enum DeadLettersCommand {
    /// Shows dead-lettered receipt messages without removing them.
    List {
        /// Show at most this many (at most 1000).
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Moves dead-lettered messages back to the receipts queue.
    Requeue {
        /// Move at most this many (default: every message in the queue when the command starts).
        #[arg(long)]
        limit: Option<u32>,
        #[command(flatten)]
        commit: CommitArgs,
    },
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum FinishOutcome {
    Succeeded,
    Declined,
}

#[derive(Args, Debug, Clone, Copy)]
pub struct CommitArgs {
    /// Apply the changes. Without it the command only prints what it would change.
    #[arg(long, conflicts_with = "dry_run")]
    pub yes: bool,
    /// Only print what would change (the default).
    #[arg(long)]
    pub dry_run: bool,
}

impl CommitArgs {
    pub fn mode(self) -> Mode {
        if self.yes && !self.dry_run {
            Mode::Apply
        } else {
            Mode::DryRun
        }
    }
}

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
        }
    }

    /// A command can print a complete report and still fail (a requeue that stopped part-way,
    /// a backlog whose broker half is unreachable).
    fn failure(&self) -> Option<String> {
        match self {
            Output::Requeue(report) => report.stopped.clone(),
            Output::Backlog(backlog) => backlog.queues_error.clone(),
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

/// `stripe` is only used by `findings refund` and `key finish`: the provider's client is built
/// for them alone.
async fn dispatch(
    command: AdminCommand,
    pool: &Pool,
    amqp_url: &str,
    settings: &AdminSettings,
    stripe: &provider::StripeConfig,
) -> Result<Output, AdminError> {
    Ok(match command {
        AdminCommand::Key(KeyCommand::Show(selector)) => {
            let selector = match (selector.key_id, selector.user_id, selector.key) {
                (Some(key_id), _, _) => keys::KeySelector::Id(key_id),
                (None, Some(user_id), Some(key)) => keys::KeySelector::UserKey { user_id, key },
                _ => {
                    return Err(AdminError::Invalid(
                        "give --key-id N, or --user-id U and --key K".into(),
                    ));
                }
            };
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
            let requester = crate::reconciler::refund::RefundRequester::operator(&operator)?;
            let stripe = stripe_client(stripe)?;
            Output::Change(
                crate::reconciler::refund::refund_finding(
                    pool,
                    &stripe,
                    id,
                    commit.mode(),
                    &requester,
                )
                .await?,
            )
        }
    })
}

impl ChangeReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let heading = match self.mode {
            Mode::DryRun => "DRY RUN, nothing changed",
            Mode::Apply => "APPLIED",
        };
        let _ = writeln!(out, "{} {}: {heading}", self.command, self.target);
        for warning in &self.warnings {
            let _ = writeln!(out, "WARNING: {warning}");
        }
        let _ = writeln!(
            out,
            "{}",
            match self.mode {
                Mode::DryRun => "Would change:",
                Mode::Apply => "Changed:",
            }
        );
        for change in &self.changes {
            let row = change
                .row
                .map_or_else(String::new, |row| format!("[{row}]"));
            match (change.column, &change.from) {
                (Some(column), Some(from)) => {
                    let _ = writeln!(
                        out,
                        "  {} {}{row}.{column}: {from} -> {}",
                        change.action, change.table, change.to
                    );
                }
                _ => {
                    let _ = writeln!(
                        out,
                        "  {} {}{row}: {}",
                        change.action, change.table, change.to
                    );
                }
            }
        }
        for note in &self.notes {
            let _ = writeln!(out, "Note: {note}");
        }
        if self.mode == Mode::DryRun {
            let _ = writeln!(out, "Re-run with --yes to apply.");
        }
        out
    }
}

fn stripe_client(stripe: &provider::StripeConfig) -> Result<provider::StripeClient, AdminError> {
    provider::StripeClient::new(stripe).map_err(|error| {
        AdminError::Internal(format!(
            "cannot build the payment provider's client: {error}"
        ))
    })
}
