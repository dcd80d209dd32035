//! A `jsonb` value carried as its JSON text, for the values the services only store and hand
//! back: a key's request parameters and its stored outcome. Diesel's `serde_json::Value` builds a
//! tree of maps for every such column it reads and walks one for every value it writes; a replay
//! read its outcome into a tree only to deserialize the tree into the outcome and drop it, about a
//! tenth of the api-server's instructions per replay (docs/performance.md). Read, the text is
//! checked to be JSON and kept as it came; written, it is sent as it is.

use std::{fmt, io::Write};

use diesel::{
    deserialize::{self, FromSql, FromSqlRow},
    expression::AsExpression,
    pg::{Pg, PgValue},
    serialize::{self, IsNull, Output, ToSql},
    sql_types::Jsonb,
};
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;

/// The version byte that starts `jsonb`'s binary form (the text follows it).
const JSONB_VERSION: u8 = 1;

/// A JSON value as text, stored and read as `jsonb`. Equality compares the values, not their
/// spelling: PostgreSQL hands `jsonb` back with its keys reordered and its spaces normalised.
#[derive(Clone, AsExpression, FromSqlRow)]
#[diesel(sql_type = Jsonb)]
pub struct JsonText(Box<RawValue>);

impl JsonText {
    /// `value` serialized.
    pub fn of<T: Serialize + ?Sized>(value: &T) -> Result<JsonText, serde_json::Error> {
        serde_json::value::to_raw_value(value).map(JsonText)
    }

    /// The value deserialized as `T`, straight from the text.
    pub fn parse<'a, T: Deserialize<'a>>(&'a self) -> Result<T, serde_json::Error> {
        serde_json::from_str(self.0.get())
    }

    /// JSON `null`: what a value of plain fields stands as in the unreachable case that it does
    /// not serialize.
    pub fn null() -> JsonText {
        JsonText(RawValue::NULL.to_owned())
    }

    /// The JSON text.
    pub fn as_str(&self) -> &str {
        self.0.get()
    }

    /// The value as a tree, for code that inspects it by field (operators' tools, tests).
    pub fn to_value(&self) -> serde_json::Value {
        // The text was checked to be JSON when it was made or read.
        self.parse().unwrap_or_default()
    }
}

impl From<serde_json::Value> for JsonText {
    fn from(value: serde_json::Value) -> JsonText {
        // A `Value` always serializes.
        JsonText::of(&value).unwrap_or_else(|_| JsonText::null())
    }
}

impl PartialEq for JsonText {
    fn eq(&self, other: &JsonText) -> bool {
        self.as_str() == other.as_str() || self.to_value() == other.to_value()
    }
}

impl fmt::Debug for JsonText {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromSql<Jsonb, Pg> for JsonText {
    fn from_sql(value: PgValue<'_>) -> deserialize::Result<JsonText> {
        match value.as_bytes().split_first() {
            Some((&JSONB_VERSION, text)) => Ok(JsonText(serde_json::from_slice(text)?)),
            _ => Err("unsupported jsonb encoding version".into()),
        }
    }
}

impl ToSql<Jsonb, Pg> for JsonText {
    fn to_sql<'b>(&'b self, out: &mut Output<'b, '_, Pg>) -> serialize::Result {
        out.write_all(&[JSONB_VERSION])?;
        out.write_all(self.as_str().as_bytes())?;
        Ok(IsNull::No)
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    #[test]
    fn equality_is_by_value_not_spelling() {
        let written = JsonText::of(&json!({"b": 1.5, "a": [1, "x"]})).unwrap();
        let read: JsonText =
            JsonText(serde_json::from_str(r#"{"a": [1, "x"], "b": 1.5}"#).unwrap());
        assert_eq!(written, read);
        assert_ne!(written, JsonText::from(json!({"a": [1, "x"], "b": 2.5})));
        assert_eq!(read.to_value()["b"], 1.5);
    }

    #[test]
    fn values_parse_straight_into_their_types() {
        #[derive(Debug, PartialEq, Serialize, Deserialize)]
        struct Point {
            lat: f64,
            lon: f64,
        }
        let point = Point {
            lat: 37.7749,
            lon: -122.4194,
        };
        assert_eq!(
            JsonText::of(&point).unwrap().parse::<Point>().unwrap(),
            point
        );
        assert!(
            JsonText::from(json!({"lat": "north"}))
                .parse::<Point>()
                .is_err()
        );
    }
}
