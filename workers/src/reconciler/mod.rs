//! The reconciler: compares the provider's PaymentIntents with the rides, window by window, and
//! records every disagreement once in `reconciliation_findings` for a human (`workers admin
//! findings …`). Retries cannot fix these: a charge that succeeded for a key that was reaped or
//! given up unfinished, a ride recording a charge the provider does not have or did not take, an
//! amount or currency that differs, a charge naming no ride.
//!
//! One pass, in one transaction that holds the watermark row's lock (so a second pass at the
//! same time skips):
//! 1. [`window`]: from the watermark less an overlap to now less the settle delay, compared one
//!    slice (`RECONCILER_SLICE_SECS`) at a time, so a pass holds one slice's ledger in memory;
//! 2. [`walk`]: the provider's PaymentIntents of the slice, the rides of the slice and the rides
//!    and keys they name; after the slices, the charges left pending that no slice listed;
//! 3. [`classify`]: every mismatch, and the charges not yet findings because their key is live;
//! 4. [`record`]: each finding once; the watermark moves on, remembering the pending charges.
//!
//! Then, only with `--refund`, [`refund`] gives back each open refundable finding's charge.

pub mod classify;
pub mod record;
pub mod refund;
pub mod walk;
pub mod window;

use std::time::Duration;

use chrono::{DateTime, Utc};
use diesel::{ExpressionMethods, QueryDsl};
use diesel_async::RunQueryDsl;
use provider::StripeClient;
use schema::{Pool, PoolError, schema::reconciliation_findings};
use serde::Serialize;
use tokio_util::sync::CancellationToken;

use crate::{
    admin::{AdminError, Mode},
    backoff::Backoff,
    config::ReconcilerConfig,
    metrics,
    worker_loop::{self, Next, Passes},
};

#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error("no database connection available")]
    Pool(#[from] PoolError),
    #[error("database error")]
    Database(#[from] diesel::result::Error),
    #[error("payment provider")]
    Provider(#[from] provider::ProviderError),
    #[error("cannot build the payment provider's client")]
    Client(#[source] reqwest::Error),
}

/// What one pass did (`--once` prints it as one JSON line).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize)]
pub struct ReconcileSummary {
    /// Another pass held the watermark: this one did nothing.
    pub skipped: bool,
    pub window_from: Option<DateTime<Utc>>,
    pub window_until: Option<DateTime<Utc>>,
    /// Whether the window reached now less the settle delay (false: it was cut at
    /// `RECONCILER_MAX_WINDOW_HOURS` and the loop goes on at once).
    pub caught_up: bool,
    /// PaymentIntents compared (the window's and those left pending before).
    pub intents: u64,
    /// Rides of the window that record a charge.
    pub rides: u64,
    /// PaymentIntents a ride records, in agreement (one whose ride is near a slice's end can be
    /// counted by both slices).
    pub matched: u64,
    /// Unrecorded charges of live keys: not findings yet, looked at again next pass.
    pub pending: u64,
    /// PaymentIntents no ride records that the ownership rule (`contract::ownership`) does not
    /// prove ours: someone else's on the shared account, left alone.
    pub foreign: u64,
    /// Of those, the ones carrying any of our metadata keys (look-alikes), by reason.
    pub look_alikes: std::collections::BTreeMap<String, u64>,
    /// Mismatches seen by this pass, and how many of them were recorded for the first time.
    pub findings: u64,
    pub new_findings: u64,
    /// With `--refund`: findings refunded, and ones whose refund was refused or failed.
    pub refunded: u64,
    pub refunds_failed: u64,
    /// With `--refund`: refundable findings left for the next pass (or an operator's
    /// `findings refund`) because this pass reached its caps.
    pub refunds_deferred: u64,
}

/// What a pass's slices add up to. The slices' ledgers are dropped one by one; what is kept is
/// counts, the earlier passes' pending charges no slice has listed yet, and the new pending ids.
#[derive(Default)]
struct Tally {
    unlisted_pending: std::collections::HashSet<String>,
    intents: u64,
    rides: u64,
    matched: u64,
    foreign: u64,
    look_alikes: std::collections::BTreeMap<String, u64>,
    findings: u64,
    new_findings: u64,
    /// A charge near a slice's end can be seen by two slices: a set, so it is pending once.
    pending: std::collections::BTreeSet<String>,
}

impl Tally {
    fn new(earlier_pending: &[String]) -> Tally {
        Tally {
            unlisted_pending: earlier_pending.iter().cloned().collect(),
            ..Tally::default()
        }
    }

    fn listed(&mut self, intents: &[provider::ListedIntent]) {
        for intent in intents {
            self.unlisted_pending.remove(&intent.id);
        }
    }

    /// Classifies one ledger, records its findings and counts them.
    async fn compared(
        &mut self,
        conn: &mut diesel_async::AsyncPgConnection,
        ledger: &classify::Ledger,
    ) -> Result<(), ReconcileError> {
        let classified = classify::classify(ledger);
        self.new_findings += record::record(conn, &classified.findings).await?;
        self.intents += ledger.intents.len() as u64;
        self.rides += ledger.window_rides.len() as u64;
        self.matched += classified.matched;
        self.foreign += classified.foreign;
        for (why, count) in &classified.look_alikes {
            *self.look_alikes.entry(why.as_str().to_owned()).or_default() += count;
        }
        self.findings += classified.findings.len() as u64;
        self.pending.extend(
            classified
                .pending
                .into_iter()
                .map(|pending| pending.payment_intent_id),
        );
        Ok(())
    }

    fn summary(&self, window: &window::Window) -> ReconcileSummary {
        ReconcileSummary {
            skipped: false,
            window_from: Some(window.from),
            window_until: Some(window.until),
            caught_up: window.caught_up,
            intents: self.intents,
            rides: self.rides,
            matched: self.matched,
            pending: self.pending.len() as u64,
            foreign: self.foreign,
            look_alikes: self.look_alikes.clone(),
            findings: self.findings,
            new_findings: self.new_findings,
            refunded: 0,
            refunds_failed: 0,
            refunds_deferred: 0,
        }
    }
}

pub struct Reconciler {
    pool: Pool,
    stripe: StripeClient,
    config: ReconcilerConfig,
}

impl Reconciler {
    pub fn new(pool: Pool, config: ReconcilerConfig) -> Result<Reconciler, ReconcileError> {
        let stripe = StripeClient::new(&config.stripe).map_err(ReconcileError::Client)?;
        Ok(Reconciler {
            pool,
            stripe,
            config,
        })
    }

    pub fn stripe(&self) -> &StripeClient {
        &self.stripe
    }

    /// One pass; with `refund`, then refunds the open refundable findings.
    pub async fn run_once(&self, refund: bool) -> Result<ReconcileSummary, ReconcileError> {
        let mut summary = self.compare().await?;
        if refund {
            self.refund_open(&mut summary).await?;
        }
        let mut conn = self.pool.get().await?;
        metrics::observe_findings(&mut conn).await;
        Ok(summary)
    }

    /// Steps 1 to 4 of a pass, in one transaction holding the watermark. REPEATABLE READ: the
    /// pass reads a window's rides, then their keys, in separate statements, and must see both
    /// as of one moment. Under READ COMMITTED a key finished between the two reads (its charge
    /// recorded in the same commit) looked finished with its charge unrecorded: a false
    /// `unrecorded_charge` finding (the refund's own re-check refused it, but it stayed open).
    /// A pass whose snapshot another pass's commit overtook (a serialization failure, at the
    /// watermark or a finding) is skipped as a pass that found the watermark held is: nothing of
    /// it was written, and the next pass covers its window.
    async fn compare(&self) -> Result<ReconcileSummary, ReconcileError> {
        let mut conn = self.pool.get().await?;
        window::ensure(&mut conn, &self.config).await?;
        let compared = conn
            .build_transaction()
            .repeatable_read()
            .run(async |conn| {
                let Some((mark, now)) = window::lock(conn).await? else {
                    tracing::info!("another reconciler pass holds the watermark; skipping");
                    return Ok(ReconcileSummary {
                        skipped: true,
                        ..ReconcileSummary::default()
                    });
                };
                let window = window::window(&mark, now, &self.config);
                let mut tally = Tally::new(&mark.pending);
                for slice in window.slices(self.config.slice) {
                    let intents = self
                        .stripe
                        .list_payment_intents(provider::CreatedWindow {
                            from: slice.from.timestamp(),
                            until: slice.until.timestamp(),
                        })
                        .await?;
                    tally.listed(&intents);
                    let ledger = walk::walk(conn, &self.stripe, Some(&slice), intents).await?;
                    tally.compared(conn, &ledger).await?;
                }
                // Charges earlier passes left pending that no slice listed: asked one by one (a
                // charge the provider no longer has is nothing to reconcile any more).
                let mut stale = Vec::new();
                for id in std::mem::take(&mut tally.unlisted_pending) {
                    if let Some(intent) = self.stripe.retrieve_payment_intent(&id).await? {
                        stale.push(intent);
                    }
                }
                if !stale.is_empty() {
                    let ledger = walk::walk(conn, &self.stripe, None, stale).await?;
                    tally.compared(conn, &ledger).await?;
                }
                let summary = tally.summary(&window);
                window::advance(conn, &mark, &window, tally.pending.into_iter().collect()).await?;
                if summary.new_findings > 0 {
                    tracing::warn!(
                        count = summary.new_findings,
                        "reconciler: new findings; see `workers admin findings list`"
                    );
                }
                Ok(summary)
            })
            .await;
        match compared {
            Err(ReconcileError::Database(diesel::result::Error::DatabaseError(
                diesel::result::DatabaseErrorKind::SerializationFailure,
                _,
            ))) => {
                tracing::info!("another reconciler pass committed meanwhile; skipping");
                Ok(ReconcileSummary {
                    skipped: true,
                    ..ReconcileSummary::default()
                })
            }
            compared => compared,
        }
    }

    /// Refunds the open findings of a refundable kind, oldest first, each through the guarded
    /// procedure of [`refund::refund_finding`] (which proves the charge ours again under locks
    /// and may refuse), until the pass's caps: `refund_max_findings` refunds and
    /// `refund_max_amount` in total. The rest wait for the next pass, or for an operator.
    async fn refund_open(&self, summary: &mut ReconcileSummary) -> Result<(), ReconcileError> {
        let open: Vec<(i64, Option<i64>)> = {
            let mut conn = self.pool.get().await?;
            reconciliation_findings::table
                .filter(reconciliation_findings::resolved_at.is_null())
                .filter(
                    reconciliation_findings::kind.eq_any(
                        schema::FindingKind::ALL
                            .into_iter()
                            .filter(|kind| kind.is_refundable())
                            .collect::<Vec<_>>(),
                    ),
                )
                .order(reconciliation_findings::id)
                .select((
                    reconciliation_findings::id,
                    reconciliation_findings::provider_amount,
                ))
                .load(&mut conn)
                .await?
        };
        let (mut count, mut amount) = (0_u32, 0_i64);
        for (id, finding_amount) in open {
            // A refundable finding always has the provider's amount; one without is not
            // refunded in bulk.
            let within = finding_amount.is_some_and(|finding_amount| {
                count < self.config.refund_max_findings
                    && finding_amount > 0
                    && amount.saturating_add(finding_amount) <= self.config.refund_max_amount
            });
            if !within {
                summary.refunds_deferred += 1;
                continue;
            }
            let requester = refund::RefundRequester::Reconciler;
            let outcome =
                refund::refund_finding(&self.pool, &self.stripe, id, Mode::Apply, &requester).await;
            // The caps bound what is sent to the provider, not what was recorded: only a
            // refusal by the checks is known to have sent nothing. Any other failure may come
            // after the provider made the refund (its recording's commit lost), so it counts.
            if !matches!(outcome, Err(AdminError::Refused(_))) {
                count += 1;
                amount = amount.saturating_add(finding_amount.unwrap_or_default());
            }
            match outcome {
                Ok(_) => summary.refunded += 1,
                Err(error) => {
                    summary.refunds_failed += 1;
                    tracing::warn!(
                        finding_id = id,
                        refused = matches!(error, AdminError::Refused(_)),
                        error = %telemetry::error_chain(&error),
                        "reconciler: refund not made"
                    );
                }
            }
        }
        if summary.refunds_deferred > 0 {
            tracing::warn!(
                deferred = summary.refunds_deferred,
                max_findings = self.config.refund_max_findings,
                max_amount = self.config.refund_max_amount,
                "reconciler: refund caps reached; the rest wait for the next pass or `workers \
                 admin findings refund <id> --operator <name> --yes`"
            );
        }
        Ok(())
    }

    pub async fn run(&self, refund: bool, shutdown_token: CancellationToken) -> ReconcileSummary {
        let interval = self.config.interval.max(Duration::from_secs(1));
        let mut passes = ReconcilerPasses {
            reconciler: self,
            refund,
            interval,
            total: ReconcileSummary::default(),
        };
        let failing = Backoff::new(Duration::from_secs(5), interval);
        worker_loop::run_passes(&mut passes, &shutdown_token, failing).await;
        passes.total
    }
}

/// The reconciler's loop state: a pass, then the interval, or at once while catching up.
struct ReconcilerPasses<'a> {
    reconciler: &'a Reconciler,
    refund: bool,
    interval: Duration,
    total: ReconcileSummary,
}

impl Passes for ReconcilerPasses<'_> {
    type Error = ReconcileError;
    const WORKER: &'static str = "reconciler";

    async fn pass(&mut self) -> Result<Next, ReconcileError> {
        let summary = self.reconciler.run_once(self.refund).await?;
        let total = &mut self.total;
        total.intents += summary.intents;
        total.rides += summary.rides;
        total.matched += summary.matched;
        total.pending = summary.pending;
        total.foreign += summary.foreign;
        for (why, count) in &summary.look_alikes {
            *total.look_alikes.entry(why.clone()).or_default() += count;
        }
        total.findings += summary.findings;
        total.new_findings += summary.new_findings;
        total.refunded += summary.refunded;
        total.refunds_failed += summary.refunds_failed;
        total.refunds_deferred += summary.refunds_deferred;
        tracing::info!(?summary, "reconciler pass");
        Ok(if !summary.skipped && !summary.caught_up {
            Next::Now
        } else {
            Next::After(self.interval)
        })
    }
}
