//! The closed set of recovery points a key moves through. The database enforces the same set with
//! a CHECK constraint; this enum is how code names them.

use diesel::{deserialize::FromSqlRow, expression::AsExpression, sql_types::Text};
use serde::{Deserialize, Serialize};

/// The last atomic phase a key has committed. A retry resumes from here.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, Hash, AsExpression, FromSqlRow, Serialize, Deserialize,
)]
#[diesel(sql_type = Text)]
#[serde(rename_all = "snake_case")]
pub enum RecoveryPoint {
    /// The key is claimed; nothing else is written yet.
    Started,
    /// The ride and its audit record exist; the charge may or may not have reached the provider.
    RideCreated,
    /// The charge is recorded on the ride; the receipt job is not staged yet.
    ChargeCreated,
    /// A final outcome is stored on the key and is replayed from now on.
    Finished,
}

impl RecoveryPoint {
    pub const ALL: [RecoveryPoint; 4] = [
        RecoveryPoint::Started,
        RecoveryPoint::RideCreated,
        RecoveryPoint::ChargeCreated,
        RecoveryPoint::Finished,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            RecoveryPoint::Started => "started",
            RecoveryPoint::RideCreated => "ride_created",
            RecoveryPoint::ChargeCreated => "charge_created",
            RecoveryPoint::Finished => "finished",
        }
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown recovery point {0:?}")]
pub struct UnknownRecoveryPoint(pub String);

crate::text_enum::text_enum!(RecoveryPoint, UnknownRecoveryPoint);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for point in RecoveryPoint::ALL {
            assert_eq!(point.as_str().parse::<RecoveryPoint>().unwrap(), point);
        }
        assert!("charged".parse::<RecoveryPoint>().is_err());
    }
}
