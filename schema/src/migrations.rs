//! `migrations/` embedded at compile time, applied over an async connection.

use diesel_async::{AsyncConnection, AsyncMigrationHarness, AsyncPgConnection};
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

/// Applies every pending migration and returns the versions it applied. Safe to run from several
/// processes at once: diesel's harness applies each migration in a transaction, and the one that
/// loses the race fails on the version's primary key instead of applying twice.
pub async fn run_pending(database_url: &str) -> Result<Vec<String>, MigrationError> {
    let connection = AsyncPgConnection::establish(database_url)
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
