//! The closed set of mismatches the reconciler records (`reconciliation_findings.kind`). The
//! database enforces the same set with a CHECK constraint; this enum is how code names them.

use diesel::{deserialize::FromSqlRow, expression::AsExpression, sql_types::Text};
use serde::{Deserialize, Serialize};

/// How the provider's ledger and the rides disagree (docs/workers.md, "Reconciler").
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, AsExpression, FromSqlRow, Serialize, Deserialize,
)]
#[diesel(sql_type = Text)]
#[serde(rename_all = "snake_case")]
pub enum FindingKind {
    /// A succeeded PaymentIntent whose ride exists but does not record it, and whose key is no
    /// longer live (reaped, given up by the completer, or finished otherwise).
    UnrecordedCharge,
    /// A succeeded PaymentIntent carrying our metadata whose `ride_id` names no ride (or is
    /// missing or unreadable).
    UnknownRide,
    /// A ride records a PaymentIntent the provider does not have.
    MissingCharge,
    /// A ride records a PaymentIntent whose status is not `succeeded`.
    ChargeNotSucceeded,
    /// A ride records a PaymentIntent of another amount.
    AmountMismatch,
    /// A ride records a PaymentIntent in another currency.
    CurrencyMismatch,
}

impl FindingKind {
    pub const ALL: [FindingKind; 6] = [
        FindingKind::UnrecordedCharge,
        FindingKind::UnknownRide,
        FindingKind::MissingCharge,
        FindingKind::ChargeNotSucceeded,
        FindingKind::AmountMismatch,
        FindingKind::CurrencyMismatch,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::UnrecordedCharge => "unrecorded_charge",
            FindingKind::UnknownRide => "unknown_ride",
            FindingKind::MissingCharge => "missing_charge",
            FindingKind::ChargeNotSucceeded => "charge_not_succeeded",
            FindingKind::AmountMismatch => "amount_mismatch",
            FindingKind::CurrencyMismatch => "currency_mismatch",
        }
    }

    /// Whether the finding is money taken that no ride stands for, so that refunding it is the
    /// remedy (only ever on an operator's explicit request).
    pub fn is_refundable(self) -> bool {
        match self {
            FindingKind::UnrecordedCharge | FindingKind::UnknownRide => true,
            FindingKind::MissingCharge
            | FindingKind::ChargeNotSucceeded
            | FindingKind::AmountMismatch
            | FindingKind::CurrencyMismatch => false,
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown finding kind {0:?}")]
pub struct UnknownFindingKind(pub String);

crate::text_enum::text_enum!(FindingKind, UnknownFindingKind);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for kind in FindingKind::ALL {
            assert_eq!(kind.as_str().parse::<FindingKind>().ok(), Some(kind));
        }
        assert!("other".parse::<FindingKind>().is_err());
    }
}
