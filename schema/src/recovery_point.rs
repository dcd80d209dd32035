//! The closed set of recovery points a key moves through. The database enforces the same set with
//! a CHECK constraint; this enum is how code names them.

use std::{fmt, io::Write, str::FromStr};

use diesel::{
    deserialize::{self, FromSql, FromSqlRow},
    expression::AsExpression,
    pg::{Pg, PgValue},
    serialize::{self, IsNull, Output, ToSql},
    sql_types::Text,
};
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

impl fmt::Display for RecoveryPoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

#[derive(Debug, thiserror::Error)]
#[error("unknown recovery point {0:?}")]
pub struct UnknownRecoveryPoint(pub String);

impl FromStr for RecoveryPoint {
    type Err = UnknownRecoveryPoint;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        RecoveryPoint::ALL
            .into_iter()
            .find(|point| point.as_str() == s)
            .ok_or_else(|| UnknownRecoveryPoint(s.to_owned()))
    }
}

impl ToSql<Text, Pg> for RecoveryPoint {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(self.as_str().as_bytes())?;
        Ok(IsNull::No)
    }
}

impl FromSql<Text, Pg> for RecoveryPoint {
    fn from_sql(bytes: PgValue<'_>) -> deserialize::Result<Self> {
        let text = std::str::from_utf8(bytes.as_bytes())?;
        Ok(text.parse()?)
    }
}

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
