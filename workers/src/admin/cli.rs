//! The `workers admin` command line (clap): every subcommand and its arguments.

use clap::{Args, Subcommand, ValueEnum};
use serde::Serialize;

use super::*;

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
    /// The upgrade step from an older server (one that committed the charge's record apart from
    /// finishing the key): retires the
    /// keys it left at `started` (no ride, no charge: a retry starts afresh) and finishes those
    /// at `charge_created` as `key finish --outcome succeeded` does. Keys with a live lock are
    /// left, and the command fails while any key is left.
    Upgrade {
        #[command(flatten)]
        commit: CommitArgs,
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

impl TryFrom<KeySelectorArgs> for super::keys::KeySelector {
    type Error = AdminError;

    fn try_from(args: KeySelectorArgs) -> Result<Self, AdminError> {
        match (args.key_id, args.user_id, args.key) {
            (Some(key_id), _, _) => Ok(super::keys::KeySelector::Id(key_id)),
            (None, Some(user_id), Some(key)) => {
                Ok(super::keys::KeySelector::UserKey { user_id, key })
            }
            _ => Err(AdminError::Invalid(
                "give --key-id N, or --user-id U and --key K".into(),
            )),
        }
    }
}
