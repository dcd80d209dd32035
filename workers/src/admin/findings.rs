//! `workers admin findings list|show|resolve|refund`: what the reconciler found (provider and
//! rides disagree), for a human to settle. `refund` is the reconciler's own guarded refund
//! (`reconciler::refund`), here one finding at a time.

use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{FindingKind, Pool, models::ReconciliationFinding, schema::reconciliation_findings};
use serde::Serialize;
use serde_json::json;

use super::render::{relative, time};
use super::{AdminError, Change, ChangeReport, Mode, bound_waits};

#[derive(Clone, Debug, Serialize)]
pub struct FindingList {
    /// Whether resolved findings are included.
    pub all: bool,
    /// Findings matching, before the limit.
    pub total: i64,
    pub findings: Vec<ReconciliationFinding>,
}

/// `findings list`: open findings (every one with `all`), oldest first.
pub async fn list(pool: &Pool, all: bool, limit: i64) -> Result<FindingList, AdminError> {
    if limit < 1 {
        return Err(AdminError::Invalid("--limit must be at least 1".into()));
    }
    let mut conn = pool.get().await?;
    conn.build_transaction()
        .read_committed()
        .read_only()
        .run(async |conn| {
            bound_waits(conn).await?;
            let mut count = reconciliation_findings::table.count().into_boxed();
            let mut query = reconciliation_findings::table
                .select(ReconciliationFinding::as_select())
                .order((
                    reconciliation_findings::first_seen_at,
                    reconciliation_findings::id,
                ))
                .limit(limit)
                .into_boxed();
            if !all {
                count = count.filter(reconciliation_findings::resolved_at.is_null());
                query = query.filter(reconciliation_findings::resolved_at.is_null());
            }
            Ok(FindingList {
                all,
                total: count.get_result(conn).await?,
                findings: query.load(conn).await?,
            })
        })
        .await
}

/// One finding in full.
#[derive(Clone, Debug, Serialize)]
pub struct FindingReport {
    pub finding: ReconciliationFinding,
    /// Whether `findings refund` applies to it.
    pub refundable: bool,
}

/// `findings show <id>`.
pub async fn show(pool: &Pool, id: i64) -> Result<FindingReport, AdminError> {
    let mut conn = pool.get().await?;
    let finding = load(&mut conn, id, Mode::DryRun).await?;
    Ok(FindingReport {
        refundable: finding.kind.is_refundable() && finding.resolved_at.is_none(),
        finding,
    })
}

/// `findings resolve <id> --note …`: marks a finding settled, with why. A later pass that sees the
/// same mismatch again leaves it resolved.
pub async fn resolve(
    pool: &Pool,
    id: i64,
    note: &str,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    super::check_note(note)?;
    let mut conn = pool.get().await?;
    let report = super::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let finding = load(conn, id, mode).await?;
            if let Some(resolved_at) = finding.resolved_at {
                return Err(AdminError::Refused(format!(
                    "finding {id} was already resolved at {}",
                    time(resolved_at)
                )));
            }
            let mut report = ChangeReport::new("findings resolve", mode, id);
            report.notes.push(describe(&finding));
            if finding.kind.is_refundable() {
                report.warnings.push(format!(
                    "this is money taken that no ride stands for; resolving it does not refund it \
                     (`workers admin findings refund {id} --operator <name> --yes` does)"
                ));
            }
            let mut resolved = Change::update(
                "reconciliation_findings",
                id,
                "resolved_at",
                serde_json::Value::Null,
                json!("now()"),
            );
            if mode.applies() {
                let resolved_at: Option<DateTime<Utc>> = diesel::update(
                    reconciliation_findings::table
                        .find(id)
                        .filter(reconciliation_findings::resolved_at.is_null()),
                )
                .set((
                    reconciliation_findings::resolved_at.eq(diesel::dsl::now),
                    reconciliation_findings::resolution.eq(note),
                ))
                .returning(reconciliation_findings::resolved_at)
                .get_result(conn)
                .await?;
                resolved.to = json!(resolved_at);
            }
            report.changes.push(resolved);
            report.changes.push(Change::update(
                "reconciliation_findings",
                id,
                "resolution",
                serde_json::Value::Null,
                json!(note),
            ));
            Ok(report)
        })
        .await?;
    if mode.applies() {
        // The note is the operator's free text; ids only in the log.
        tracing::info!(finding_id = id, "admin: reconciliation finding resolved");
    }
    Ok(report)
}

/// Finding `id`, locked (`FOR UPDATE`) when `mode` applies a change to it.
pub(crate) async fn load(
    conn: &mut AsyncPgConnection,
    id: i64,
    mode: Mode,
) -> Result<ReconciliationFinding, AdminError> {
    let query = reconciliation_findings::table
        .find(id)
        .select(ReconciliationFinding::as_select());
    let finding = if mode.applies() {
        query.for_update().first(conn).await.optional()?
    } else {
        query.first(conn).await.optional()?
    };
    finding.ok_or_else(|| AdminError::NotFound(format!("no finding with id {id}")))
}

/// What a finding says, in a sentence (rendered from its columns).
pub fn describe(f: &ReconciliationFinding) -> String {
    let pi = &f.payment_intent_id;
    let ride = optional(f.ride_id);
    let provider = format!(
        "{} {}",
        optional(f.provider_amount),
        f.provider_currency.as_deref().unwrap_or("-")
    );
    let recorded = format!(
        "{} {}",
        optional(f.ride_amount),
        f.ride_currency.as_deref().unwrap_or("-")
    );
    match f.kind {
        FindingKind::UnrecordedCharge => format!(
            "{pi} took {provider} for ride {ride}, which does not record it; key {} is no longer \
             live (reaped, given up or finished)",
            optional(f.idempotency_key_id)
        ),
        FindingKind::UnknownRide => format!(
            "{pi} took {provider}, carries this deployment's marker (ride {ride}, key {}) but is \
             not provably ours (key reaped or unknown, or another customer, ride or amount); \
             never refunded by the tools: check it at the provider, then `resolve`",
            optional(f.idempotency_key_id)
        ),
        FindingKind::MissingCharge => {
            format!("ride {ride} records {pi}, which the provider does not have")
        }
        FindingKind::ChargeNotSucceeded => format!(
            "ride {ride} records {pi}, whose status is {}",
            f.provider_status.as_deref().unwrap_or("-")
        ),
        FindingKind::AmountMismatch => {
            format!("ride {ride} costs {recorded} but {pi} charged {provider}")
        }
        FindingKind::CurrencyMismatch => {
            format!("ride {ride} is in {recorded} but {pi} charged {provider}")
        }
        FindingKind::OversizedValue => format!(
            "the provider gave a value longer than this service stores: a PaymentIntent's id, \
             currency or status (compared no further), or the id or currency of a refund made \
             of it (recorded cut to fit); shown cut to fit: {pi}, status {}: look it up at the \
             provider",
            f.provider_status.as_deref().unwrap_or("-")
        ),
        FindingKind::RefundedCharge => format!(
            "ride {ride} records {pi} as its payment, but the charge was refunded; the ride \
             still counts as paid"
        ),
    }
}

/// One finding on one line, as `findings list` prints it.
fn line(finding: &ReconciliationFinding, now: DateTime<Utc>) -> String {
    format!(
        "#{} {} {} ride {} user {} key {}; first seen {}; {}",
        finding.id,
        finding.kind,
        finding.payment_intent_id,
        optional(finding.ride_id),
        optional(finding.user_id),
        optional(finding.idempotency_key_id),
        relative(finding.first_seen_at, now),
        finding
            .resolved_at
            .map_or_else(|| "OPEN".to_owned(), |at| format!("resolved {}", time(at))),
    )
}

fn optional<T: std::fmt::Display>(value: Option<T>) -> String {
    value.map_or_else(|| "-".to_owned(), |value| value.to_string())
}

impl FindingList {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let now = Utc::now();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} finding(s){}, showing {} (oldest first)",
            self.total,
            if self.all { "" } else { " open" },
            self.findings.len()
        );
        for finding in &self.findings {
            let _ = writeln!(out, "{}", line(finding, now));
            let _ = writeln!(out, "    {}", describe(finding));
        }
        out
    }
}

impl FindingReport {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let now = Utc::now();
        let f = &self.finding;
        let mut out = String::new();
        let _ = writeln!(out, "{}", line(f, now));
        let _ = writeln!(out, "  what:       {}", describe(f));
        let _ = writeln!(
            out,
            "  provider:   {} {} status {}",
            optional(f.provider_amount),
            f.provider_currency.as_deref().unwrap_or("-"),
            f.provider_status
                .as_deref()
                .unwrap_or("- (no such PaymentIntent)")
        );
        let _ = writeln!(
            out,
            "  ride:       {} {}",
            optional(f.ride_amount),
            f.ride_currency.as_deref().unwrap_or("- (no ride)")
        );
        let _ = writeln!(out, "  last seen:  {}", relative(f.last_seen_at, now));
        if let Some(resolution) = &f.resolution {
            let _ = writeln!(out, "  resolution: {resolution}");
        }
        if let Some(refund_id) = &f.refund_id {
            let _ = writeln!(out, "  refund:     {refund_id}");
        }
        if self.refundable {
            let _ = writeln!(
                out,
                "Money taken that no ride stands for: `workers admin findings refund {} --operator <name> --yes` \
                 refunds it (once), or resolve it with a note.",
                f.id
            );
        }
        out
    }
}
