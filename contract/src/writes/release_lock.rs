//! Releasing a key's lock without finishing it: see `release_lock.sql`.

use diesel::{
    QueryResult,
    sql_types::{Array, BigInt, Uuid as SqlUuid},
};
use diesel_async::AsyncPgConnection;
use uuid::Uuid;

use super::{KeyFence, fence_arrays, moved_per_key};

schema::statement! {
    /// The one statement that unlocks a key without finishing it (`release_lock.sql`).
    pub struct ReleaseLock = include_str!("release_lock.sql");
    {
        key_ids: Array<BigInt> = Vec<i64>,
        tokens: Array<SqlUuid> = Vec<Uuid>,
        user_ids: Array<BigInt> = Vec<i64>,
    }
}

impl ReleaseLock {
    /// Releases the lock of each of `keys` that its token still holds; per key, in order,
    /// whether it was released.
    pub async fn run(conn: &mut AsyncPgConnection, keys: &[KeyFence]) -> QueryResult<Vec<bool>> {
        let (key_ids, tokens, user_ids) = fence_arrays(keys.iter().copied());
        let statement = ReleaseLock {
            key_ids,
            tokens,
            user_ids,
        };
        let moved = statement.load(conn).await?;
        Ok(moved_per_key(keys.iter().copied(), moved))
    }
}
