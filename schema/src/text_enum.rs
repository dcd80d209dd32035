//! The one way a closed set of names is stored as TEXT (the database holds the same set in a CHECK
//! constraint): `Display`, `FromStr` and Diesel's `ToSql`/`FromSql` from the type's `ALL` and
//! `as_str`, so a name is spelled in exactly one place.

/// Implements `Display`, `FromStr` (failing with `$unknown(name)`), `ToSql<Text, Pg>` and
/// `FromSql<Text, Pg>` for `$type`, which has `const ALL` and `fn as_str(self) -> &'static str`.
macro_rules! text_enum {
    ($type:ty, $unknown:ident) => {
        impl std::fmt::Display for $type {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl std::str::FromStr for $type {
            type Err = $unknown;

            fn from_str(s: &str) -> Result<Self, Self::Err> {
                <$type>::ALL
                    .into_iter()
                    .find(|value| value.as_str() == s)
                    .ok_or_else(|| $unknown(s.to_owned()))
            }
        }

        impl diesel::serialize::ToSql<diesel::sql_types::Text, diesel::pg::Pg> for $type {
            fn to_sql<'b>(
                &'b self,
                out: &mut diesel::serialize::Output<'b, '_, diesel::pg::Pg>,
            ) -> diesel::serialize::Result {
                std::io::Write::write_all(out, self.as_str().as_bytes())?;
                Ok(diesel::serialize::IsNull::No)
            }
        }

        impl diesel::deserialize::FromSql<diesel::sql_types::Text, diesel::pg::Pg> for $type {
            fn from_sql(bytes: diesel::pg::PgValue<'_>) -> diesel::deserialize::Result<Self> {
                let text = std::str::from_utf8(bytes.as_bytes())?;
                Ok(text.parse()?)
            }
        }
    };
}

pub(crate) use text_enum;
