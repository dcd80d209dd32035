//! Hand-written SQL that is still prepared once per connection, with its parameters bound by
//! name.
//!
//! Some statements cannot be written with diesel's DSL (data-modifying CTEs, `INSERT … SELECT …
//! ON CONFLICT`). `diesel::sql_query` runs them, but diesel never caches a `sql_query` as a
//! prepared statement (its `walk_ast` marks itself unsafe to cache, because its text may be built
//! at run time), so PostgreSQL would parse and plan it on every execution. [`prepared`] wraps a
//! `sql_query` whose text is a `'static` constant of a [`Statement`] type, and gives it that type
//! as its static query id: diesel-async's per-connection statement cache then prepares it once.
//!
//! [`statement!`](crate::statement) declares such a statement from one SQL text that names its
//! parameters (`$key_ids`, not `$1`) and one struct with a field per parameter. The names are
//! turned into positions while the crate compiles ([`bind_names`]), in the struct's field
//! order, which is also the order the fields are bound in: a parameter the struct lacks, or a
//! field the SQL never uses, stops the build, and reordering either side changes nothing.

use std::marker::PhantomData;

use diesel::{
    QueryResult,
    pg::Pg,
    query_builder::{AstPass, Query, QueryFragment, QueryId, SqlQuery},
};

/// One constant SQL statement. The implementing type is the statement's cache key, so every type
/// must have its own `SQL` and nothing else may vary the text.
pub trait Statement: 'static {
    const SQL: &'static str;
}

/// A [`Statement`] with its bind values, runnable with `diesel_async::RunQueryDsl` and loadable
/// into `QueryableByName` rows.
#[derive(Clone, Debug)]
pub struct Prepared<S, Q> {
    query: Q,
    statement: PhantomData<fn() -> S>,
}

/// `S::SQL` with the binds `bind` adds (`|q| q.bind::<BigInt, _>(id)…`, in `$n` order).
pub fn prepared<S: Statement, Q>(bind: impl FnOnce(SqlQuery) -> Q) -> Prepared<S, Q> {
    Prepared {
        query: bind(diesel::sql_query(S::SQL)),
        statement: PhantomData,
    }
}

impl<S: Statement, Q: QueryFragment<Pg>> QueryFragment<Pg> for Prepared<S, Q> {
    fn walk_ast<'b>(&'b self, pass: AstPass<'_, 'b, Pg>) -> QueryResult<()> {
        self.query.walk_ast(pass)
    }

    fn is_safe_to_cache_prepared(&self, _backend: &Pg) -> QueryResult<bool> {
        // The text is `S::SQL` and nothing else: the same SQL for the same cache key.
        Ok(true)
    }
}

impl<S: Statement, Q> QueryId for Prepared<S, Q> {
    type QueryId = S;
    const HAS_STATIC_QUERY_ID: bool = true;
}

impl<S, Q: Query> Query for Prepared<S, Q> {
    type SqlType = Q::SqlType;
}

/// Declares a [`Statement`] whose SQL (a `&'static str` expression, usually `include_str!` of a
/// `.sql` file beside the phase that runs it) names its parameters `$field`, and the struct that
/// binds them: one field per parameter, each with its SQL type and its Rust type
/// (`key_ids: Array<BigInt> = Vec<i64>`). The struct gets `load`, which runs the statement with
/// every field bound by name and reads its rows.
///
/// ```ignore
/// schema::statement! {
///     /// Doc of the statement.
///     pub struct ReleaseLock = include_str!("release_lock.sql") {
///         key_ids: Array<BigInt> = Vec<i64>,
///         tokens: Array<diesel::sql_types::Uuid> = Vec<uuid::Uuid>,
///     }
/// }
/// ```
#[macro_export]
macro_rules! statement {
    (
        $(#[$meta:meta])*
        $vis:vis struct $name:ident = $sql:expr;
        {
            $( $(#[$field_meta:meta])* $field:ident : $sql_type:ty = $rust_type:ty ),+ $(,)?
        }
    ) => {
        $(#[$meta])*
        $vis struct $name {
            $( $(#[$field_meta])* pub $field: $rust_type, )+
        }

        impl $crate::prepared::Statement for $name {
            const SQL: &'static str = {
                const SOURCE: &str = $sql;
                const NAMES: &[&str] = &[$(stringify!($field)),+];
                const BOUND: [u8; SOURCE.len()] = $crate::prepared::bind_names(SOURCE, NAMES);
                match ::core::str::from_utf8(&BOUND) {
                    Ok(sql) => sql,
                    // Unreachable: only ASCII names are replaced, by ASCII.
                    Err(_) => SOURCE,
                }
            };
        }

        impl $name {
            /// Runs the statement with every field bound by name, reading its rows.
            pub async fn load<R>(
                &self,
                conn: &mut ::diesel_async::AsyncPgConnection,
            ) -> ::diesel::QueryResult<Vec<R>>
            where
                R: ::diesel::QueryableByName<::diesel::pg::Pg> + Send + 'static,
            {
                let query = $crate::prepared::prepared::<Self, _>(|q| {
                    q $( .bind::<$sql_type, _>(&self.$field) )+
                });
                ::diesel_async::RunQueryDsl::load(query, conn).await
            }
        }
    };
}

/// `source` with each `$name` (a letter or `_`, then letters, digits and `_`) replaced by `$n`,
/// `n` being the name's place in `names` counted from 1, padded with spaces to the name's length
/// so that the text keeps its length (and error positions their place). `--` comments and
/// `'…'` literals are copied untouched. Meant for constants ([`statement!`](crate::statement)): a
/// name not in `names`, an entry of `names` the text never uses, or a name shorter than its
/// number then fails the build with the message below.
#[allow(
    clippy::panic,
    reason = "evaluated while compiling: a panic here is a build error"
)]
pub const fn bind_names<const N: usize>(source: &str, names: &[&str]) -> [u8; N] {
    let src = source.as_bytes();
    let mut out = [b' '; N];
    let mut used = [false; MAX_PARAMS];
    if src.len() != N || names.len() > MAX_PARAMS {
        panic!("bind_names: the output length must be the source's, with at most 99 names");
    }
    let mut i = 0;
    while i < N {
        let byte = src[i];
        let copy_to = if byte == b'-' && i + 1 < N && src[i + 1] == b'-' {
            end_of_line(src, i)
        } else if byte == b'\'' {
            end_of_literal(src, i)
        } else if byte == b'$' && i + 1 < N && is_name_start(src[i + 1]) {
            let mut end = i + 1;
            while end < N && is_name_char(src[end]) {
                end += 1;
            }
            let index = position(names, src, i + 1, end);
            used[index] = true;
            write_number(&mut out, i, end, index + 1);
            i = end;
            continue;
        } else {
            i + 1
        };
        while i < copy_to {
            out[i] = src[i];
            i += 1;
        }
    }
    let mut k = 0;
    while k < names.len() {
        if !used[k] {
            panic!("a field of the statement's struct is not a parameter of its SQL");
        }
        k += 1;
    }
    out
}

/// Positions are written as one or two digits.
const MAX_PARAMS: usize = 99;

const fn is_name_start(byte: u8) -> bool {
    byte.is_ascii_lowercase() || byte.is_ascii_uppercase() || byte == b'_'
}

const fn is_name_char(byte: u8) -> bool {
    is_name_start(byte) || byte.is_ascii_digit()
}

/// Where the `--` comment starting at `from` ends (its newline, or the end of the text).
const fn end_of_line(src: &[u8], from: usize) -> usize {
    let mut i = from;
    while i < src.len() && src[i] != b'\n' {
        i += 1;
    }
    i
}

/// Just past the `'…'` literal starting at `from` (a doubled `''` inside reads as two literals
/// back to back, which copies the same bytes).
const fn end_of_literal(src: &[u8], from: usize) -> usize {
    let mut i = from + 1;
    while i < src.len() && src[i] != b'\'' {
        i += 1;
    }
    if i < src.len() { i + 1 } else { i }
}

/// The place in `names` of `src[start..end]`.
#[allow(
    clippy::panic,
    reason = "evaluated while compiling: a panic here is a build error"
)]
const fn position(names: &[&str], src: &[u8], start: usize, end: usize) -> usize {
    let mut k = 0;
    while k < names.len() {
        let name = names[k].as_bytes();
        if name.len() == end - start {
            let mut j = 0;
            while j < name.len() && name[j] == src[start + j] {
                j += 1;
            }
            if j == name.len() {
                return k;
            }
        }
        k += 1;
    }
    panic!("the statement's SQL names a parameter its struct has no field for");
}

/// `$number` over `out[at..end]` (the `$name` it replaces), the rest left as spaces.
#[allow(
    clippy::panic,
    reason = "evaluated while compiling: a panic here is a build error"
)]
const fn write_number<const N: usize>(out: &mut [u8; N], at: usize, end: usize, number: usize) {
    let digits = if number < 10 { 1 } else { 2 };
    if end - at < 1 + digits {
        panic!("a parameter name is shorter than its position: give it a longer name");
    }
    out[at] = b'$';
    if digits == 1 {
        out[at + 1] = b'0' + number as u8;
    } else {
        out[at + 1] = b'0' + (number / 10) as u8;
        out[at + 2] = b'0' + (number % 10) as u8;
    }
}

#[cfg(test)]
// `Pair::load` is run against a database by the statements that use the macro (contract's
// tests); here only its text and fields are checked.
#[allow(dead_code)]
mod tests {
    use diesel::sql_types::BigInt;

    use super::*;

    struct One;
    impl Statement for One {
        const SQL: &'static str = "SELECT $1::int8 AS id";
    }

    #[test]
    fn is_cached_under_its_statement_type() {
        let query = prepared::<One, _>(|q| q.bind::<BigInt, _>(7_i64));
        assert!(query.is_safe_to_cache_prepared(&Pg).unwrap());
        assert_eq!(
            <Prepared<One, SqlQuery> as QueryId>::query_id(),
            Some(std::any::TypeId::of::<One>())
        );
        assert_eq!(
            diesel::debug_query::<Pg, _>(&query).to_string(),
            "SELECT $1::int8 AS id -- binds: [7]"
        );
    }

    const RENAMED: [u8; 62] = bind_names(
        "SELECT $ids::int8[], $ids, '$no' -- $no\n, $tokens::uuid[] AS x",
        &["tokens", "ids"],
    );

    #[test]
    fn names_become_positions_outside_literals_and_comments() {
        assert_eq!(
            std::str::from_utf8(&RENAMED).unwrap(),
            "SELECT $2  ::int8[], $2  , '$no' -- $no\n, $1     ::uuid[] AS x"
        );
    }

    crate::statement! {
        /// A statement declared by name.
        struct Pair = "SELECT $second::int8 AS id, $first_one::text AS label";
        {
            first_one: diesel::sql_types::Text = String,
            second: BigInt = i64,
        }
    }

    #[test]
    fn a_declared_statement_binds_its_fields_by_name() {
        assert_eq!(
            <Pair as Statement>::SQL,
            "SELECT $2     ::int8 AS id, $1        ::text AS label"
        );
        // The struct has exactly the SQL's parameters, typed as declared: this builds.
        let _ = Pair {
            first_one: "a".into(),
            second: 7,
        };
    }
}
