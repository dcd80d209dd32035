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
    /// A succeeded PaymentIntent carrying this deployment's marker that the ownership rule does
    /// not prove ours (its key reaped or unknown, or another customer, ride or amount): for a
    /// person to look into, never refunded by the tools.
    UnknownRide,
    /// A ride records a PaymentIntent the provider does not have.
    MissingCharge,
    /// A ride records a PaymentIntent whose status is not `succeeded`.
    ChargeNotSucceeded,
    /// A ride records a PaymentIntent of another amount.
    AmountMismatch,
    /// A ride records a PaymentIntent in another currency.
    CurrencyMismatch,
    /// A ride records a PaymentIntent whose charge was (partly) refunded: the ride still counts
    /// as paid.
    RefundedCharge,
    /// A PaymentIntent whose id, currency or status is longer than the findings' columns allow:
    /// recorded with its values cut to fit, compared no further.
    OversizedValue,
}

impl FindingKind {
    pub const ALL: [FindingKind; 8] = [
        FindingKind::UnrecordedCharge,
        FindingKind::UnknownRide,
        FindingKind::MissingCharge,
        FindingKind::ChargeNotSucceeded,
        FindingKind::AmountMismatch,
        FindingKind::CurrencyMismatch,
        FindingKind::RefundedCharge,
        FindingKind::OversizedValue,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FindingKind::UnrecordedCharge => "unrecorded_charge",
            FindingKind::UnknownRide => "unknown_ride",
            FindingKind::MissingCharge => "missing_charge",
            FindingKind::ChargeNotSucceeded => "charge_not_succeeded",
            FindingKind::AmountMismatch => "amount_mismatch",
            FindingKind::CurrencyMismatch => "currency_mismatch",
            FindingKind::RefundedCharge => "refunded_charge",
            FindingKind::OversizedValue => "oversized_value",
        }
    }

    /// Whether the finding is money of ours taken that no ride stands for, so that refunding it
    /// is the remedy (only ever on an operator's explicit request, and only once the charge is
    /// proven ours again when it is refunded). An `unknown_ride` is not: nothing proves whose
    /// money it is, so a person settles it at the provider.
    pub fn is_refundable(self) -> bool {
        match self {
            FindingKind::UnrecordedCharge => true,
            FindingKind::UnknownRide
            | FindingKind::MissingCharge
            | FindingKind::ChargeNotSucceeded
            | FindingKind::AmountMismatch
            | FindingKind::CurrencyMismatch
            | FindingKind::RefundedCharge
            | FindingKind::OversizedValue => false,
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
