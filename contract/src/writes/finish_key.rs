//! Finishing a key with a stored outcome and nothing else: see `finish_key.sql`.

use diesel::{
    QueryResult,
    sql_types::{Array, BigInt, Integer, Jsonb, Uuid as SqlUuid},
};
use diesel_async::AsyncPgConnection;
use uuid::Uuid;

use super::{KeyFence, fence_arrays, moved_per_key};
use crate::StoredResponse;

schema::statement! {
    /// The one statement that finishes a key with an outcome and no other write
    /// (`finish_key.sql`).
    pub struct FinishKey = include_str!("finish_key.sql");
    {
        key_ids: Array<BigInt> = Vec<i64>,
        tokens: Array<SqlUuid> = Vec<Uuid>,
        user_ids: Array<BigInt> = Vec<i64>,
        response_codes: Array<Integer> = Vec<i32>,
        response_bodies: Array<Jsonb> = Vec<schema::JsonText>,
    }
}

/// One key to finish, and the outcome it replays from then on.
#[derive(Clone, Debug)]
pub struct KeyFinish {
    pub fence: KeyFence,
    pub outcome: StoredResponse,
}

impl FinishKey {
    /// Finishes each of `keys` whose fence passes; per key, in order, whether it was finished.
    pub async fn run(conn: &mut AsyncPgConnection, keys: &[KeyFinish]) -> QueryResult<Vec<bool>> {
        let fences = || keys.iter().map(|key| key.fence);
        let (key_ids, tokens, user_ids) = fence_arrays(fences());
        let statement = FinishKey {
            key_ids,
            tokens,
            user_ids,
            response_codes: keys.iter().map(|key| key.outcome.code).collect(),
            response_bodies: keys.iter().map(|key| key.outcome.body.clone()).collect(),
        };
        let moved = statement.load(conn).await?;
        Ok(moved_per_key(fences(), moved))
    }
}
