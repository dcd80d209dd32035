//! One PostgreSQL database per test, cloned from a migrated template (as crates.io does with
//! schemas), so tests run in parallel under nextest without seeing each other's rows.
//!
//! The template is named after a hash of `migrations/`, built once under an advisory lock by
//! whichever test process gets there first, and cloned with `CREATE DATABASE … TEMPLATE`, which
//! takes tens of milliseconds instead of re-running every migration.
//!
//! `TEST_DATABASE_URL` (default `postgres://postgres@127.0.0.1:5432/postgres`) names the server and
//! a maintenance database to connect to.
#![allow(clippy::expect_used, clippy::panic)]

use std::{
    collections::hash_map::DefaultHasher,
    hash::{Hash, Hasher},
    net::SocketAddr,
    path::Path,
    sync::{
        Arc,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
    time::Duration,
};

use diesel::{QueryableByName, sql_types::BigInt};
use diesel_async::{AsyncConnection, AsyncPgConnection, RunQueryDsl};
use rand::Rng;

use crate::{PlanCache, Pool, build_pool, tls::database_url};

const DEFAULT_ADMIN_URL: &str = "postgres://postgres@127.0.0.1:5432/postgres";
/// Arbitrary, fixed: serialises template builds across test processes.
const TEMPLATE_LOCK_ID: i64 = 0x7269_6465_735f_746d;

/// A database that exists for one test and is dropped with it.
pub struct TestDatabase {
    name: String,
    url: String,
    admin_url: String,
}

impl TestDatabase {
    pub async fn new() -> TestDatabase {
        let admin_url =
            std::env::var("TEST_DATABASE_URL").unwrap_or_else(|_| DEFAULT_ADMIN_URL.to_owned());
        let template = ensure_template(&admin_url).await;
        let name = format!("rides_test_{:016x}", rand::rng().random::<u64>());
        let mut admin = AsyncPgConnection::establish(&admin_url)
            .await
            .expect("connect to the test PostgreSQL server (TEST_DATABASE_URL)");
        // Two clones of one template at the same instant can trip "source database is being
        // accessed by other users"; that is a passing condition, so try again briefly.
        let mut attempt = 0;
        loop {
            let created = diesel::sql_query(format!(
                "CREATE DATABASE \"{name}\" TEMPLATE \"{template}\""
            ))
            .execute(&mut admin)
            .await;
            match created {
                Ok(_) => break,
                Err(error) if attempt < 50 => {
                    attempt += 1;
                    tracing::debug!(%error, attempt, "retrying CREATE DATABASE from template");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Err(error) => panic!("cannot create test database {name}: {error}"),
            }
        }
        let url = database_url(&admin_url, &name);
        TestDatabase {
            name,
            url,
            admin_url,
        }
    }

    pub fn url(&self) -> &str {
        &self.url
    }

    pub fn name(&self) -> &str {
        &self.name
    }

    pub fn pool(&self, max_size: u32) -> Pool {
        build_pool(
            &self.url,
            max_size,
            Duration::from_secs(30),
            PlanCache::Auto,
        )
    }

    /// A connection as the processes open theirs (`crate::connect`: the session declarations
    /// included).
    pub async fn connect(&self) -> AsyncPgConnection {
        crate::connect(&self.url)
            .await
            .expect("connect to the test database")
    }

    /// A connection holding `table` locked (`ACCESS EXCLUSIVE`) until it sends `COMMIT`: every
    /// statement on the table waits meanwhile.
    pub async fn lock_table(&self, table: &str) -> AsyncPgConnection {
        let mut locker = self.connect_as_an_older_process().await;
        let lock = format!("LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE");
        for statement in ["BEGIN", lock.as_str()] {
            diesel::sql_query(statement)
                .execute(&mut locker)
                .await
                .unwrap_or_else(|error| panic!("{statement}: {error}"));
        }
        locker
    }

    /// A connection as a process from before [`crate::tls::SESSION_DECLARATIONS`] opened its
    /// own: what an older server's statements run on, for the fences against it.
    pub async fn connect_as_an_older_process(&self) -> AsyncPgConnection {
        AsyncPgConnection::establish(&self.url)
            .await
            .expect("connect to the test database")
    }
}

impl Drop for TestDatabase {
    fn drop(&mut self) {
        let admin_url = self.admin_url.clone();
        let name = self.name.clone();
        // Drop runs inside (or outside) an async runtime; a thread with its own runtime works in
        // both cases. FORCE ends the test's own pooled connections.
        let dropped = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime for dropping the test database");
            runtime.block_on(async move {
                if let Ok(mut admin) = AsyncPgConnection::establish(&admin_url).await {
                    let _ = diesel::sql_query(format!(
                        "DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"
                    ))
                    .execute(&mut admin)
                    .await;
                }
            });
        })
        .join();
        if dropped.is_err() {
            eprintln!("could not drop test database {}", self.name);
        }
    }
}

#[derive(QueryableByName)]
struct Count {
    #[diesel(sql_type = BigInt)]
    count: i64,
}

async fn ensure_template(admin_url: &str) -> String {
    let template = format!("rides_template_{:016x}", migrations_hash());
    let mut admin = AsyncPgConnection::establish(admin_url)
        .await
        .expect("connect to the test PostgreSQL server (TEST_DATABASE_URL)");
    diesel::sql_query(format!("SELECT pg_advisory_lock({TEMPLATE_LOCK_ID})"))
        .execute(&mut admin)
        .await
        .expect("take the template lock");
    let exists = diesel::sql_query(format!(
        "SELECT count(*) AS count FROM pg_database WHERE datname = '{template}'"
    ))
    .get_result::<Count>(&mut admin)
    .await
    .expect("look up the template database")
    .count
        > 0;
    if !exists {
        // Built under a temporary name and renamed when complete, so a crash mid-build never
        // leaves a half-migrated template behind the real name.
        let building = format!("{template}_building");
        for statement in [
            format!("DROP DATABASE IF EXISTS \"{building}\" WITH (FORCE)"),
            format!("CREATE DATABASE \"{building}\""),
        ] {
            diesel::sql_query(statement)
                .execute(&mut admin)
                .await
                .expect("prepare the template database");
        }
        crate::migrations::run_pending(&database_url(admin_url, &building))
            .await
            .expect("migrate the template database");
        diesel::sql_query(format!(
            "ALTER DATABASE \"{building}\" RENAME TO \"{template}\""
        ))
        .execute(&mut admin)
        .await
        .expect("publish the template database");
    }
    diesel::sql_query(format!("SELECT pg_advisory_unlock({TEMPLATE_LOCK_ID})"))
        .execute(&mut admin)
        .await
        .expect("release the template lock");
    template
}

fn migrations_hash() -> u64 {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../migrations");
    let mut entries: Vec<_> = walk(&dir);
    entries.sort();
    let mut hasher = DefaultHasher::new();
    for path in entries {
        path.strip_prefix(&dir).unwrap_or(&path).hash(&mut hasher);
        std::fs::read(&path)
            .expect("read a migration file")
            .hash(&mut hasher);
    }
    hasher.finish()
}

fn walk(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read migrations/").flatten() {
        let path = entry.path();
        if path.is_dir() {
            files.extend(walk(&path));
        } else {
            files.push(path);
        }
    }
    files
}

/// A TCP proxy to `target` (`host:port`) that refuses every connection while `up` is false: the
/// database as a client sees it during a restart. It counts the connections asked of it in
/// `tries`, and lives as long as the test's runtime.
pub async fn switchable_proxy(
    target: String,
    up: Arc<AtomicBool>,
    tries: Arc<AtomicUsize>,
) -> SocketAddr {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind the test proxy");
    let addr = listener.local_addr().expect("the test proxy's address");
    tokio::spawn(async move {
        while let Ok((mut client, _)) = listener.accept().await {
            tries.fetch_add(1, Ordering::SeqCst);
            if !AtomicBool::load(&up, Ordering::SeqCst) {
                continue; // dropped: the connection is refused
            }
            let target = target.clone();
            tokio::spawn(async move {
                if let Ok(mut server) = tokio::net::TcpStream::connect(target).await {
                    let _ = tokio::io::copy_bidirectional(&mut client, &mut server).await;
                }
            });
        }
    });
    addr
}

/// `url` (a `postgres://user@host:port/database` URL, a [`TestDatabase`]'s) through a new
/// [`switchable_proxy`] that `up` switches; and the proxy's count of tries.
pub async fn through_switchable_proxy(
    url: &str,
    up: &Arc<AtomicBool>,
) -> (String, Arc<AtomicUsize>) {
    let (userinfo, rest) = url.split_once('@').expect("a URL with user@host");
    let (server, database) = rest.split_once('/').expect("a URL with /database");
    let tries = Arc::new(AtomicUsize::new(0));
    let proxy = switchable_proxy(server.to_owned(), Arc::clone(up), Arc::clone(&tries)).await;
    (format!("{userinfo}@{proxy}/{database}"), tries)
}
