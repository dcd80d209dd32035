//! The watermark: how far the reconciler has compared the ledgers, one row in
//! `reconciler_watermarks`. Each pass reads from the watermark less an overlap to now less the
//! settle delay (at most `max_window` at once), then moves the watermark to the window's end and
//! remembers the charges still pending. The row's lock, taken `SKIP LOCKED` for the whole pass,
//! is also what keeps two passes from running at once: the second finds it locked and skips.

use chrono::{DateTime, SubsecRound, Utc};
use diesel::{ExpressionMethods, OptionalExtension, QueryDsl};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use schema::schema::reconciler_watermarks;

use super::ReconcileError;
use crate::config::ReconcilerConfig;

/// The one reconciler's row (the table allows more, e.g. per provider account).
pub const WATERMARK: &str = "payment_intents";

/// `from <= created < until`, whole seconds (the provider's `created` is in seconds).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Window {
    pub from: DateTime<Utc>,
    pub until: DateTime<Utc>,
    /// Whether the window reaches `now − settle delay` (or was cut at `max_window`, and the loop
    /// should go on at once).
    pub caught_up: bool,
}

impl Window {
    /// The window cut into consecutive slices of at most `length` (whole seconds, at least one),
    /// together covering exactly the window: a pass compares one slice at a time.
    pub fn slices(&self, length: std::time::Duration) -> impl Iterator<Item = Window> + use<> {
        let step =
            chrono::Duration::seconds(i64::try_from(length.as_secs().max(1)).unwrap_or(i64::MAX));
        let (until, caught_up) = (self.until, self.caught_up);
        let mut from = self.from;
        std::iter::from_fn(move || {
            if from >= until {
                return None;
            }
            let end = from
                .checked_add_signed(step)
                .map_or(until, |end| end.min(until));
            let slice = Window {
                from,
                until: end,
                caught_up,
            };
            from = end;
            Some(slice)
        })
    }
}

#[derive(Clone, Debug)]
pub(super) struct Watermark {
    pub reconciled_until: DateTime<Utc>,
    pub pending: Vec<String>,
}

/// Creates the row the first time, starting `initial_lookback` before now.
pub(super) async fn ensure(
    conn: &mut AsyncPgConnection,
    config: &ReconcilerConfig,
) -> Result<(), ReconcileError> {
    let start = minus(db_now(conn).await?, config.initial_lookback);
    diesel::insert_into(reconciler_watermarks::table)
        .values((
            reconciler_watermarks::name.eq(WATERMARK),
            reconciler_watermarks::reconciled_until.eq(start),
        ))
        .on_conflict_do_nothing()
        .execute(conn)
        .await?;
    Ok(())
}

/// Locks the row for this pass, with the database's now; `None` if another pass holds it.
pub(super) async fn lock(
    conn: &mut AsyncPgConnection,
) -> Result<Option<(Watermark, DateTime<Utc>)>, ReconcileError> {
    let row: Option<(DateTime<Utc>, Vec<String>)> = reconciler_watermarks::table
        .find(WATERMARK)
        .select((
            reconciler_watermarks::reconciled_until,
            reconciler_watermarks::pending_payment_intents,
        ))
        .for_update()
        .skip_locked()
        .first(conn)
        .await
        .optional()?;
    let Some((reconciled_until, pending)) = row else {
        return Ok(None);
    };
    let now = db_now(conn).await?;
    Ok(Some((
        Watermark {
            reconciled_until,
            pending,
        },
        now,
    )))
}

/// The window a pass reads.
pub(super) fn window(mark: &Watermark, now: DateTime<Utc>, config: &ReconcilerConfig) -> Window {
    let settled = minus(now, config.settle_delay);
    let from = minus(mark.reconciled_until, config.overlap);
    let capped = mark
        .reconciled_until
        .checked_add_signed(contract::key::chrono_duration(config.max_window))
        .unwrap_or(DateTime::<Utc>::MAX_UTC);
    let until = settled.min(capped).max(mark.reconciled_until);
    Window {
        from: from.trunc_subsecs(0),
        until: until.trunc_subsecs(0),
        caught_up: settled <= capped,
    }
}

/// Moves the watermark to the window's end (never back) and stores the pending charges.
pub(super) async fn advance(
    conn: &mut AsyncPgConnection,
    mark: &Watermark,
    window: &Window,
    pending: Vec<String>,
) -> Result<(), ReconcileError> {
    diesel::update(reconciler_watermarks::table.find(WATERMARK))
        .set((
            reconciler_watermarks::reconciled_until.eq(window.until.max(mark.reconciled_until)),
            reconciler_watermarks::pending_payment_intents.eq(pending),
            reconciler_watermarks::updated_at.eq(diesel::dsl::now),
        ))
        .execute(conn)
        .await?;
    Ok(())
}

/// `at − duration`, saturating at the start of time (a configured duration may be huge).
fn minus(at: DateTime<Utc>, duration: std::time::Duration) -> DateTime<Utc> {
    at.checked_sub_signed(contract::key::chrono_duration(duration))
        .unwrap_or(DateTime::<Utc>::MIN_UTC)
}

async fn db_now(conn: &mut AsyncPgConnection) -> Result<DateTime<Utc>, ReconcileError> {
    Ok(
        diesel::select(diesel::dsl::sql::<diesel::sql_types::Timestamptz>("now()"))
            .get_result(conn)
            .await?,
    )
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn config() -> ReconcilerConfig {
        ReconcilerConfig {
            stripe: provider::StripeConfig {
                api_base: String::new(),
                secret_key: provider::Secret::new("sk_test_x"),
                timeout: Duration::from_secs(1),
                idempotency_window: Duration::from_secs(1),
                deployment_id: provider::DeploymentId::parse("test").unwrap(),
            },
            settle_delay: Duration::from_secs(600),
            overlap: Duration::from_secs(3600),
            initial_lookback: Duration::from_secs(7 * 86_400),
            max_window: Duration::from_secs(86_400),
            slice: Duration::from_secs(60),
            interval: Duration::from_secs(3600),
            refund_max_findings: 5,
            refund_max_amount: 10_000,
        }
    }

    fn at(secs: i64) -> DateTime<Utc> {
        DateTime::from_timestamp(secs, 500_000_000).unwrap_or_default()
    }

    #[test]
    fn a_window_starts_an_overlap_before_the_mark_and_ends_a_settle_delay_before_now() {
        let mark = Watermark {
            reconciled_until: at(100_000),
            pending: Vec::new(),
        };
        let window = window(&mark, at(110_000), &config());
        assert_eq!(window.from.timestamp(), 100_000 - 3600);
        assert_eq!(window.until.timestamp(), 110_000 - 600);
        assert_eq!(window.until.timestamp_subsec_nanos(), 0, "whole seconds");
        assert!(window.caught_up);
    }

    #[test]
    fn a_window_far_behind_is_cut_at_the_maximum_and_never_ends_before_the_mark() {
        let mark = Watermark {
            reconciled_until: at(0),
            pending: Vec::new(),
        };
        let behind = window(&mark, at(10 * 86_400), &config());
        assert_eq!(behind.until.timestamp(), 86_400);
        assert!(!behind.caught_up);
        let ahead = window(&mark, at(100), &config());
        assert_eq!(ahead.until.timestamp(), 0);
    }

    #[test]
    fn slices_cover_the_window_exactly_once_in_order() {
        let window = Window {
            from: at(1_000),
            until: at(1_150),
            caught_up: true,
        };
        let slices: Vec<Window> = window.slices(Duration::from_secs(60)).collect();
        let bounds: Vec<(i64, i64)> = slices
            .iter()
            .map(|s| (s.from.timestamp(), s.until.timestamp()))
            .collect();
        assert_eq!(bounds, vec![(1_000, 1_060), (1_060, 1_120), (1_120, 1_150)]);
        assert!(slices.iter().all(|s| s.caught_up));
        let empty = Window {
            from: at(1_000),
            until: at(1_000),
            caught_up: true,
        };
        assert_eq!(empty.slices(Duration::from_secs(60)).count(), 0);
        // A zero length is taken as one second, never an endless loop.
        assert_eq!(window.slices(Duration::ZERO).count(), 150);
    }
}
