//! `contract::unflushed!` against the real PostgreSQL: a write joined with it sets
//! `synchronous_commit` off for its own transaction, so that transaction's commit does not wait
//! for the WAL flush, and for no other.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use diesel::{QueryableByName, sql_query, sql_types::Text};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use schema::testing::TestDatabase;

#[derive(QueryableByName)]
struct Setting {
    #[diesel(sql_type = Text)]
    synchronous_commit: String,
}

async fn synchronous_commit(conn: &mut AsyncPgConnection) -> String {
    sql_query("SELECT current_setting('synchronous_commit') AS synchronous_commit")
        .get_result::<Setting>(conn)
        .await
        .unwrap()
        .synchronous_commit
}

/// A write shaped as the phases write: the rows come from a source joined with `unflushed`.
const WRITE: &str = concat!(
    "WITH ",
    contract::unflushed!(),
    ", source AS (SELECT 1 AS v) \
     INSERT INTO written (v) SELECT source.v FROM source CROSS JOIN unflushed"
);

#[tokio::test(flavor = "multi_thread")]
async fn a_write_joined_with_it_commits_unflushed_and_only_its_own_transaction_does() {
    let db = TestDatabase::new().await;
    let mut conn = db.connect().await;
    sql_query("CREATE TABLE written (v int)")
        .execute(&mut conn)
        .await
        .unwrap();
    assert_eq!(synchronous_commit(&mut conn).await, "on");

    // Seen from inside the transaction, before its commit reads the setting.
    conn.transaction::<_, diesel::result::Error, _>(async |conn| {
        sql_query(WRITE).execute(conn).await?;
        assert_eq!(synchronous_commit(conn).await, "off");
        Ok(())
    })
    .await
    .unwrap();

    // Alone, as the phases run (an implicit transaction): the next statement is flushed again.
    assert_eq!(sql_query(WRITE).execute(&mut conn).await.unwrap(), 1);
    assert_eq!(synchronous_commit(&mut conn).await, "on");
}
