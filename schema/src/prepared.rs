//! Hand-written SQL that is still prepared once per connection.
//!
//! Some statements cannot be written with diesel's DSL (data-modifying CTEs, `INSERT … SELECT …
//! ON CONFLICT`). `diesel::sql_query` runs them, but diesel never caches a `sql_query` as a
//! prepared statement (its `walk_ast` marks itself unsafe to cache, because its text may be built
//! at run time), so PostgreSQL would parse and plan it on every execution. [`prepared`] wraps a
//! `sql_query` whose text is a `'static` constant of a [`Statement`] type, and gives it that type
//! as its static query id: diesel-async's per-connection statement cache then prepares it once.

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

#[cfg(test)]
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
}
