//! `workers admin keys needing-attention|resolve`: the list of keys automation gave up on.

use std::collections::HashMap;
use std::fmt::Write as _;

use chrono::{DateTime, Utc};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl, SelectableHelper};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::{
    Pool, RecoveryPoint,
    models::KeyNeedingAttention,
    schema::{idempotency_keys, keys_needing_attention},
};
use serde::Serialize;
use serde_json::{Value, json};

use super::render::{relative, time};
use super::{AdminError, Change, ChangeReport, Mode, bound_waits};
use crate::redact;

/// One `keys_needing_attention` row, with the key's state now.
#[derive(Clone, Debug, Serialize)]
pub struct AttentionRow {
    pub id: i64,
    pub recorded_at: DateTime<Utc>,
    /// `completer_gave_up` or `reaped_unfinished`.
    pub reason: String,
    pub idempotency_key_id: i64,
    pub user_id: i64,
    pub idempotency_key: String,
    /// Where the key was when the row was recorded.
    pub recovery_point: RecoveryPoint,
    pub request_params: Value,
    pub last_error: Option<String>,
    pub resolved_at: Option<DateTime<Utc>>,
    /// Where the key is now; `None` when it no longer exists (reaped).
    pub key_recovery_point_now: Option<RecoveryPoint>,
}

#[derive(Clone, Debug, Serialize)]
pub struct AttentionList {
    /// Whether resolved rows are included.
    pub all: bool,
    /// Rows matching, before the limit.
    pub total: i64,
    pub rows: Vec<AttentionRow>,
}

/// Adds each row's current key state.
pub(crate) async fn with_key_state(
    conn: &mut AsyncPgConnection,
    rows: Vec<KeyNeedingAttention>,
) -> Result<Vec<AttentionRow>, AdminError> {
    let ids: Vec<i64> = rows.iter().map(|row| row.idempotency_key_id).collect();
    let user_ids: Vec<i64> = rows.iter().map(|row| row.user_id).collect();
    let points: HashMap<(i64, i64), RecoveryPoint> = idempotency_keys::table
        .filter(idempotency_keys::id.eq_any(&ids))
        .filter(idempotency_keys::user_id.eq_any(&user_ids))
        .select((
            idempotency_keys::id,
            idempotency_keys::user_id,
            idempotency_keys::recovery_point,
        ))
        .load::<(i64, i64, RecoveryPoint)>(conn)
        .await?
        .into_iter()
        .map(|(id, user_id, point)| ((id, user_id), point))
        .collect();
    Ok(rows
        .into_iter()
        .map(|row| AttentionRow {
            key_recovery_point_now: points.get(&(row.idempotency_key_id, row.user_id)).copied(),
            id: row.id,
            recorded_at: row.recorded_at,
            reason: row.reason,
            idempotency_key_id: row.idempotency_key_id,
            user_id: row.user_id,
            idempotency_key: row.idempotency_key,
            recovery_point: row.recovery_point,
            request_params: row.request_params,
            last_error: row.last_error,
            resolved_at: row.resolved_at,
        })
        .collect())
}

/// `keys needing-attention`: unresolved rows (every row with `all`), oldest first.
pub async fn list(pool: &Pool, all: bool, limit: i64) -> Result<AttentionList, AdminError> {
    if limit < 1 {
        return Err(AdminError::Invalid("--limit must be at least 1".into()));
    }
    let mut conn = pool.get().await?;
    conn.build_transaction()
        .read_committed()
        .read_only()
        .run(async |conn| {
            bound_waits(conn).await?;
            let mut count = keys_needing_attention::table.count().into_boxed();
            let mut query = keys_needing_attention::table
                .select(KeyNeedingAttention::as_select())
                .order((
                    keys_needing_attention::recorded_at,
                    keys_needing_attention::id,
                ))
                .limit(limit)
                .into_boxed();
            if !all {
                count = count.filter(keys_needing_attention::resolved_at.is_null());
                query = query.filter(keys_needing_attention::resolved_at.is_null());
            }
            let total: i64 = count.get_result(conn).await?;
            let rows = query.load(conn).await?;
            Ok(AttentionList {
                all,
                total,
                rows: with_key_state(conn, rows).await?,
            })
        })
        .await
}

/// `keys resolve`: marks one row resolved (`resolved_at = now()`). The key itself is not
/// touched. The note is printed and logged: the table has no column for it.
pub async fn resolve(
    pool: &Pool,
    id: i64,
    note: Option<&str>,
    mode: Mode,
) -> Result<ChangeReport, AdminError> {
    if let Some(note) = note {
        super::check_note(note)?;
    }
    let mut conn = pool.get().await?;
    let report = super::change_transaction(&mut conn, mode)
        .run(async |conn| {
            bound_waits(conn).await?;
            let query = keys_needing_attention::table
                .find(id)
                .select(KeyNeedingAttention::as_select());
            let row = if mode.applies() {
                query.for_update().first(conn).await.optional()?
            } else {
                query.first(conn).await.optional()?
            };
            let Some(row) = row else {
                return Err(AdminError::NotFound(format!(
                    "no keys_needing_attention row with id {id}"
                )));
            };
            if let Some(resolved_at) = row.resolved_at {
                return Err(AdminError::Refused(format!(
                    "keys_needing_attention row {id} was already resolved at {}",
                    super::render::time(resolved_at)
                )));
            }
            let mut report = ChangeReport::new("keys resolve", mode, id);
            note_the_key(conn, &row, &mut report).await?;
            if let Some(note) = note {
                report.notes.push(format!("note: {note}"));
            }
            let mut change = Change::update(
                "keys_needing_attention",
                id,
                "resolved_at",
                Value::Null,
                json!("now()"),
            );
            if mode.applies() {
                let resolved_at: Option<DateTime<Utc>> = diesel::update(
                    keys_needing_attention::table
                        .find(id)
                        .filter(keys_needing_attention::user_id.eq(row.user_id))
                        .filter(keys_needing_attention::resolved_at.is_null()),
                )
                .set(keys_needing_attention::resolved_at.eq(diesel::dsl::now))
                .returning(keys_needing_attention::resolved_at)
                .get_result(conn)
                .await?;
                change.to = json!(resolved_at);
            }
            report.changes.push(change);
            // The note is free text: keep the key out of the log line if it was pasted in.
            let logged_note = note
                .map(|note| note.replace(&row.idempotency_key, &redact::key(&row.idempotency_key)));
            Ok((report, logged_note))
        })
        .await?;
    let (report, logged_note) = report;
    if mode.applies() {
        tracing::info!(
            attention_id = id,
            note = logged_note.as_deref(),
            "admin: keys_needing_attention row resolved"
        );
    }
    Ok(report)
}

/// What resolving the row leaves of its key, as a note or a warning for the operator.
async fn note_the_key(
    conn: &mut AsyncPgConnection,
    row: &KeyNeedingAttention,
    report: &mut ChangeReport,
) -> Result<(), AdminError> {
    let key_now: Option<RecoveryPoint> = idempotency_keys::table
        .find(row.idempotency_key_id)
        .filter(idempotency_keys::user_id.eq(row.user_id))
        .select(idempotency_keys::recovery_point)
        .first(conn)
        .await
        .optional()?;
    match key_now {
        Some(RecoveryPoint::Finished) => report.notes.push(format!(
            "key {} is finished; nothing is left to do for it",
            row.idempotency_key_id
        )),
        Some(point) => report.warnings.push(format!(
            "key {} still exists unfinished at {point}; resolving this row does not \
             change the key (see `workers admin key show --key-id {}`)",
            row.idempotency_key_id, row.idempotency_key_id
        )),
        None => report.notes.push(format!(
            "key {} no longer exists (reaped)",
            row.idempotency_key_id
        )),
    }
    Ok(())
}

/// One attention row, as `key show` and `keys needing-attention` print it.
pub(super) fn line(row: &AttentionRow, now: DateTime<Utc>) -> String {
    format!(
        "#{} {} recorded {} at {}; {}; key now {}; last error: {}",
        row.id,
        row.reason,
        relative(row.recorded_at, now),
        row.recovery_point,
        row.resolved_at.map_or_else(
            || "UNRESOLVED".to_owned(),
            |at| format!("resolved {}", time(at))
        ),
        row.key_recovery_point_now
            .map_or_else(|| "gone (reaped)".to_owned(), |point| point.to_string()),
        row.last_error.as_deref().unwrap_or("-")
    )
}

impl AttentionList {
    /// The report as text, for a terminal.
    pub fn render(&self) -> String {
        let now = Utc::now();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{} keys_needing_attention row(s){}, showing {} (oldest first)",
            self.total,
            if self.all { "" } else { " unresolved" },
            self.rows.len()
        );
        for row in &self.rows {
            let _ = writeln!(out, "{}", line(row, now));
            let _ = writeln!(
                out,
                "    key {} user {} {:?} params {}",
                row.idempotency_key_id, row.user_id, row.idempotency_key, row.request_params
            );
        }
        out
    }
}
