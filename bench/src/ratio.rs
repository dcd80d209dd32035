//! Every service figure is reported as a ratio to what the database itself can do on the same
//! machine (the pgbench ceiling), and judged against a goal stated as such a ratio.

/// `measured / ceiling`; `None` when the ceiling is unknown, zero or not finite.
pub fn ratio(measured: f64, ceiling: f64) -> Option<f64> {
    (ceiling.is_finite() && ceiling > 0.0 && measured.is_finite()).then(|| measured / ceiling)
}

/// The ceiling of a scenario in which every request waits `provider_latency_s` on the provider:
/// `clients` requests in flight can finish at most `clients / latency` per second (Little's law),
/// and never faster than the database allows. So the ceiling is the smaller of the two.
pub fn latency_bound_ceiling(db_ceiling_tps: f64, clients: u32, provider_latency_s: f64) -> f64 {
    if provider_latency_s <= 0.0 {
        return db_ceiling_tps;
    }
    let littles_law = f64::from(clients) / provider_latency_s;
    if db_ceiling_tps.is_finite() && db_ceiling_tps > 0.0 {
        db_ceiling_tps.min(littles_law)
    } else {
        littles_law
    }
}

/// How a figure compares with its goal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Verdict {
    Met,
    Missed,
    /// No figure (not measured, or no ceiling to divide by).
    Unknown,
}

impl Verdict {
    pub fn as_str(self) -> &'static str {
        match self {
            Verdict::Met => "met",
            Verdict::Missed => "MISSED",
            Verdict::Unknown => "n/a",
        }
    }
}

/// A goal: the figure must be at least (`AtLeast`) or below (`Below`) the bound.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Goal {
    AtLeast(f64),
    AtMost(f64),
    Below(f64),
}

impl Goal {
    pub fn judge(self, value: Option<f64>) -> Verdict {
        match value {
            None => Verdict::Unknown,
            Some(value) if !value.is_finite() => Verdict::Unknown,
            Some(value) => {
                let met = match self {
                    Goal::AtLeast(bound) => value >= bound,
                    Goal::AtMost(bound) => value <= bound,
                    Goal::Below(bound) => value < bound,
                };
                if met { Verdict::Met } else { Verdict::Missed }
            }
        }
    }

    pub fn describe(self) -> String {
        match self {
            Goal::AtLeast(bound) => format!(">= {bound}"),
            Goal::AtMost(bound) => format!("<= {bound}"),
            Goal::Below(bound) => format!("< {bound}"),
        }
    }
}

/// Several conditions that must all hold: missed if any is missed, unknown if none is missed
/// but one could not be judged.
pub fn all(verdicts: &[Verdict]) -> Verdict {
    if verdicts.contains(&Verdict::Missed) {
        Verdict::Missed
    } else if verdicts.contains(&Verdict::Unknown) {
        Verdict::Unknown
    } else {
        Verdict::Met
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ratio_divides_and_refuses_useless_ceilings() {
        assert_eq!(ratio(800.0, 1000.0), Some(0.8));
        assert_eq!(ratio(1.0, 0.0), None);
        assert_eq!(ratio(1.0, -5.0), None);
        assert_eq!(ratio(1.0, f64::NAN), None);
        assert_eq!(ratio(f64::INFINITY, 10.0), None);
    }

    #[test]
    fn latency_bound_ceiling_takes_the_smaller_bound() {
        // 500 clients each waiting 250 ms can finish at most 2000 requests per second.
        assert_eq!(latency_bound_ceiling(5000.0, 500, 0.25), 2000.0);
        // A slower database is the tighter bound.
        assert_eq!(latency_bound_ceiling(1500.0, 500, 0.25), 1500.0);
        // No latency: only the database bounds it; no database figure: only Little's law.
        assert_eq!(latency_bound_ceiling(1500.0, 500, 0.0), 1500.0);
        assert_eq!(latency_bound_ceiling(f64::NAN, 500, 0.25), 2000.0);
    }

    #[test]
    fn goals_judge_their_bounds_inclusively_or_not() {
        assert_eq!(Goal::AtLeast(0.8).judge(Some(0.8)), Verdict::Met);
        assert_eq!(Goal::AtLeast(0.8).judge(Some(0.79)), Verdict::Missed);
        assert_eq!(Goal::AtMost(100.0).judge(Some(100.0)), Verdict::Met);
        assert_eq!(Goal::Below(100.0).judge(Some(100.0)), Verdict::Missed);
        assert_eq!(Goal::Below(100.0).judge(Some(99.9)), Verdict::Met);
        assert_eq!(Goal::AtLeast(0.8).judge(None), Verdict::Unknown);
        assert_eq!(Goal::AtLeast(0.8).judge(Some(f64::NAN)), Verdict::Unknown);
    }

    #[test]
    fn all_needs_every_condition() {
        assert_eq!(all(&[Verdict::Met, Verdict::Met]), Verdict::Met);
        assert_eq!(all(&[Verdict::Met, Verdict::Unknown]), Verdict::Unknown);
        assert_eq!(all(&[Verdict::Unknown, Verdict::Missed]), Verdict::Missed);
    }
}
