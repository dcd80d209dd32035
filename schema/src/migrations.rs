//! `migrations/` embedded at compile time, applied over an async connection.

use diesel_async::{AsyncMigrationHarness, RunQueryDsl};

use crate::tls::connect;
use diesel_migrations::{EmbeddedMigrations, MigrationHarness, embed_migrations};

pub const MIGRATIONS: EmbeddedMigrations = embed_migrations!("../migrations");

#[derive(Debug, thiserror::Error)]
pub enum MigrationError {
    #[error("cannot connect to the database")]
    Connect(#[source] diesel::ConnectionError),
    #[error("a migration failed")]
    Migrate(#[source] Box<dyn std::error::Error + Send + Sync>),
    #[error("the migration task stopped unexpectedly")]
    Join(#[source] tokio::task::JoinError),
}

/// Creates the database named in `database_url` if it does not exist yet, connecting to the
/// server's `postgres` maintenance database to do so. Returns whether it created it.
pub async fn create_database_if_missing(database_url: &str) -> Result<bool, MigrationError> {
    match connect(database_url).await {
        Ok(_) => return Ok(false),
        // PostgreSQL's own wording (SQLSTATE 3D000); diesel does not expose the code here.
        Err(error) if error.to_string().contains("does not exist") => {}
        Err(error) => return Err(MigrationError::Connect(error)),
    }
    let Some(name) = database_name(database_url) else {
        return Err(MigrationError::Connect(
            diesel::ConnectionError::InvalidConnectionUrl(
                "the database URL names no database".into(),
            ),
        ));
    };
    let mut admin = connect(&crate::tls::database_url(database_url, "postgres"))
        .await
        .map_err(MigrationError::Connect)?;
    let quoted = name.replace('"', "\"\"");
    match diesel::sql_query(format!("CREATE DATABASE \"{quoted}\""))
        .execute(&mut admin)
        .await
    {
        Ok(_) => Ok(true),
        // Another process created it between our two connections.
        Err(diesel::result::Error::DatabaseError(_, info))
            if info.message().contains("already exists") =>
        {
            Ok(false)
        }
        Err(error) => Err(MigrationError::Migrate(Box::new(error))),
    }
}

/// `name` from `postgres://host:port[,host:port…]/name?options`.
fn database_name(url: &str) -> Option<&str> {
    let without_query = url.split('?').next()?;
    let authority_start = without_query.find("://")? + 3;
    let slash = authority_start + without_query[authority_start..].find('/')?;
    let name = &without_query[slash + 1..];
    (!name.is_empty()).then_some(name)
}

/// Applies every pending migration and returns the versions it applied. Safe to run from several
/// processes at once: diesel's harness applies each migration in a transaction, and the one that
/// loses the race fails on the version's primary key instead of applying twice.
pub async fn run_pending(database_url: &str) -> Result<Vec<String>, MigrationError> {
    let connection = connect(database_url)
        .await
        .map_err(MigrationError::Connect)?;
    // The harness drives the synchronous migration machinery with `block_in_place`; a blocking
    // task keeps that legal on any runtime flavour.
    tokio::task::spawn_blocking(move || {
        let mut harness = AsyncMigrationHarness::new(connection);
        harness
            .run_pending_migrations(MIGRATIONS)
            .map(|versions| versions.iter().map(ToString::to_string).collect())
            .map_err(MigrationError::Migrate)
    })
    .await
    .map_err(MigrationError::Join)?
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_the_database_name_off_a_url() {
        assert_eq!(
            database_name("postgres://u:p@h:5432/rides?sslmode=disable"),
            Some("rides")
        );
        assert_eq!(
            database_name("postgres://h1:1,h2:2/rides?target_session_attrs=read-write"),
            Some("rides")
        );
        assert_eq!(database_name("postgres://h:5432/"), None);
        assert_eq!(database_name("postgres://h:5432"), None);
    }
}
