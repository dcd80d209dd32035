//! PostgreSQL over TLS through the pool and `schema::connect`, against the test server. It must
//! have `ssl = on`; when it has not, each test prints why it is skipped (never silently).
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use std::{path::PathBuf, time::Duration};

use diesel::{QueryableByName, sql_types::Bool};
use diesel_async::{AsyncPgConnection, RunQueryDsl};
use rcgen::{BasicConstraints, CertificateParams, IsCa, KeyPair};
use schema::{PlanCache, build_pool, testing::TestDatabase};

#[derive(QueryableByName)]
struct Ssl {
    #[diesel(sql_type = Bool)]
    ssl: bool,
}

/// Whether this very session is encrypted, as the server sees it.
async fn encrypted(conn: &mut AsyncPgConnection) -> bool {
    diesel::sql_query("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .get_result::<Ssl>(conn)
        .await
        .unwrap()
        .ssl
}

/// The test server's `ssl` setting; prints the reason when a test must skip.
async fn server_has_tls(db: &TestDatabase) -> bool {
    #[derive(QueryableByName)]
    struct Setting {
        #[diesel(sql_type = diesel::sql_types::Text)]
        ssl: String,
    }
    let setting = diesel::sql_query("SELECT current_setting('ssl') AS ssl")
        .get_result::<Setting>(&mut db.connect().await)
        .await
        .unwrap();
    if setting.ssl != "on" {
        println!(
            "SKIPPED: the test PostgreSQL server has ssl = {}",
            setting.ssl
        );
    }
    setting.ssl == "on"
}

fn with(url: &str, params: &str) -> String {
    let separator = if url.contains('?') { '&' } else { '?' };
    format!("{url}{separator}{params}")
}

#[tokio::test(flavor = "multi_thread")]
async fn sslmode_require_encrypts_pooled_connections() {
    let db = TestDatabase::new().await;
    if !server_has_tls(&db).await {
        return;
    }
    let pool = build_pool(
        &with(db.url(), "sslmode=require"),
        2,
        Duration::from_secs(10),
        PlanCache::Generic,
    );
    let mut conn = pool.get().await.unwrap();
    assert!(encrypted(&mut conn).await, "sslmode=require");
    // The pool's session defaults still apply over TLS.
    #[derive(QueryableByName)]
    struct Mode {
        #[diesel(sql_type = diesel::sql_types::Text)]
        plan_cache_mode: String,
    }
    let mode = diesel::sql_query("SELECT current_setting('plan_cache_mode') AS plan_cache_mode")
        .get_result::<Mode>(&mut conn)
        .await
        .unwrap();
    assert_eq!(mode.plan_cache_mode, "force_generic_plan");

    let plain = build_pool(db.url(), 1, Duration::from_secs(10), PlanCache::Auto);
    assert!(
        !encrypted(&mut plain.get().await.unwrap()).await,
        "no sslmode stays plaintext"
    );
    let prefer = schema::connect(&with(db.url(), "sslmode=prefer")).await;
    assert!(encrypted(&mut prefer.unwrap()).await, "sslmode=prefer");
}

#[tokio::test(flavor = "multi_thread")]
async fn migrations_honour_sslmode() {
    let db = TestDatabase::new().await;
    if !server_has_tls(&db).await {
        return;
    }
    let url = with(db.url(), "sslmode=require");
    assert!(
        !schema::migrations::create_database_if_missing(&url)
            .await
            .unwrap()
    );
    assert_eq!(
        schema::migrations::run_pending(&url).await.unwrap(),
        Vec::<String>::new(),
        "the clone of the template is migrated already"
    );
    let bogus = with(db.url(), "sslmode=verify-full");
    assert!(schema::migrations::run_pending(&bogus).await.is_err());
}

/// A PEM file in a fresh directory.
struct TempPem(PathBuf);

impl TempPem {
    fn new(contents: &str) -> TempPem {
        let dir = std::env::temp_dir().join(format!("rides-pg-tls-{}", rand_suffix()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("root.pem");
        std::fs::write(&path, contents).unwrap();
        TempPem(path)
    }
}

impl Drop for TempPem {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

fn rand_suffix() -> String {
    format!(
        "{}-{:?}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    )
}

#[tokio::test(flavor = "multi_thread")]
async fn verify_full_refuses_a_server_its_root_did_not_sign() {
    let db = TestDatabase::new().await;
    if !server_has_tls(&db).await {
        return;
    }
    let mut params = CertificateParams::new(vec!["localhost".to_owned()]).unwrap();
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    let stranger = params.self_signed(&KeyPair::generate().unwrap()).unwrap();
    let root = TempPem::new(&stranger.pem());
    for mode in ["verify-full", "verify-ca", "require"] {
        let url = with(
            db.url(),
            &format!("sslmode={mode}&sslrootcert={}", root.0.display()),
        );
        let Err(error) = schema::connect(&url).await else {
            panic!("sslmode={mode} accepted a server certificate its root did not sign");
        };
        assert!(
            error.to_string().contains("certificate"),
            "sslmode={mode}: {error}"
        );
    }
}

/// The server's own certificate as the root: Debian's snakeoil is self-signed for `localhost`.
#[tokio::test(flavor = "multi_thread")]
async fn verify_full_checks_the_host_name_and_verify_ca_does_not() {
    let db = TestDatabase::new().await;
    if !server_has_tls(&db).await {
        return;
    }
    #[derive(QueryableByName)]
    struct CertFile {
        #[diesel(sql_type = diesel::sql_types::Text)]
        ssl_cert_file: String,
    }
    let cert_file = diesel::sql_query("SELECT current_setting('ssl_cert_file') AS ssl_cert_file")
        .get_result::<CertFile>(&mut db.connect().await)
        .await
        .unwrap()
        .ssl_cert_file;
    let Ok(pem) = std::fs::read_to_string(&cert_file) else {
        println!("SKIPPED: the server's certificate {cert_file} is not readable here");
        return;
    };
    let root = TempPem::new(&pem);
    let root = root.0.display();
    let by_ip = db.url().to_owned();
    let by_name = by_ip.replace("@127.0.0.1:", "@localhost:");
    if by_name == by_ip {
        println!("SKIPPED: the test database URL does not name 127.0.0.1");
        return;
    }

    let mut conn = schema::connect(&with(
        &by_name,
        &format!("sslmode=verify-full&sslrootcert={root}"),
    ))
    .await
    .unwrap();
    assert!(encrypted(&mut conn).await);
    let mut conn = schema::connect(&with(
        &by_ip,
        &format!("sslmode=verify-ca&sslrootcert={root}"),
    ))
    .await
    .unwrap();
    assert!(encrypted(&mut conn).await);
    let Err(error) = schema::connect(&with(
        &by_ip,
        &format!("sslmode=verify-full&sslrootcert={root}"),
    ))
    .await
    else {
        panic!("verify-full accepted a certificate for localhost at 127.0.0.1");
    };
    assert!(error.to_string().contains("certificate"), "{error}");
}
