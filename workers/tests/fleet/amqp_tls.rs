//! The enqueuer and the receipt worker over `amqps://` against a real RabbitMQ TLS listener
//! (issue 33): a node of the test's own (`workers::testing::RabbitNode`) whose only listener
//! speaks TLS with a certificate from a throwaway CA. A broker whose certificate another CA
//! signed is refused before anything is published, and a plaintext client gets nowhere.

use std::{path::PathBuf, time::Duration};

use api_server::testing::{TestApp, TestCa};
use tokio::net::TcpListener;
use workers::{
    amqp::AmqpSession,
    enqueuer::Enqueuer,
    mailer::receipt_message_id,
    testing::{NodeTls, RabbitNode},
};

use crate::common::{self, DEADLINE, TestBroker};

/// A RabbitMQ node listening for AMQP over TLS only, killed and deleted on drop.
struct TlsBroker {
    node: RabbitNode,
    dir: PathBuf,
}

impl TlsBroker {
    async fn start(signed_by: &TestCa) -> TlsBroker {
        assert!(
            RabbitNode::available(),
            "the TLS broker test needs Debian's rabbitmq-server (deploy/local/test.sh installs it)"
        );
        let id = uuid::Uuid::new_v4().simple().to_string();
        let dir = std::env::temp_dir().join(format!("rides-amqp-tls-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        let (cert, key) = signed_by.issue("rabbitmq");
        let tls = NodeTls {
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            ca: dir.join("ca.pem"),
        };
        std::fs::write(&tls.cert, cert).unwrap();
        std::fs::write(&tls.key, key).unwrap();
        std::fs::write(&tls.ca, &signed_by.cert_pem).unwrap();
        let node = RabbitNode::configure(
            &dir.join("node"),
            &format!("rides-test-{}", &id[..12]),
            free_port().await,
            free_port().await,
            Some(tls),
        )
        .unwrap();
        node.start().await.unwrap();
        TlsBroker { node, dir }
    }

    /// The node's URL with a different CA file to verify it against.
    fn url_trusting(&self, ca: &TestCa) -> String {
        let path = self
            .dir
            .join(format!("trusted-{}.pem", uuid::Uuid::new_v4()));
        std::fs::write(&path, &ca.cert_pem).unwrap();
        self.node.url_trusting(&path)
    }
}

impl Drop for TlsBroker {
    fn drop(&mut self) {
        self.node.kill();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

async fn free_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    listener.local_addr().unwrap().port()
}

#[tokio::test(flavor = "multi_thread")]
async fn the_enqueuer_and_the_receipt_worker_work_over_amqps() {
    let ca = TestCa::new("amqp-ca");
    let tls_broker = TlsBroker::start(&ca).await;
    let url = tls_broker.node.url();
    assert!(url.starts_with("amqps://"), "{url}");
    let app = TestApp::spawn().await;
    let broker = TestBroker::at(&url, 5).await;
    // Published by the enqueuer over amqps:// and confirmed: the staged row is gone.
    let ride_id = common::paid_ride(&app, &broker).await;
    assert!(common::staged_ids(&app.pool).await.is_empty());

    // The consumer loop, which opens its own amqps:// connection.
    let sink = common::mail_sink().await;
    let worker = common::receipt_worker(&app.pool, &broker, &sink);
    let shutdown = workers::CancellationToken::new();
    let consumer = tokio::spawn({
        let (url, shutdown) = (url.clone(), shutdown.clone());
        async move { worker.run(&url, shutdown).await }
    });
    let deadline = tokio::time::Instant::now() + DEADLINE;
    while sink.received().is_empty() && tokio::time::Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    shutdown.cancel();
    let consumed = consumer.await.unwrap();
    assert_eq!(consumed.sent, 1, "{consumed:?}");
    let mails = sink.received();
    assert_eq!(mails.len(), 1, "one receipt, through the TLS broker");
    assert_eq!(mails[0].message_id(), Some(receipt_message_id(ride_id)));
    assert_eq!(broker.depth(&broker.topology.receipts_queue).await, 0);
    broker.cleanup().await;
}

#[tokio::test(flavor = "multi_thread")]
async fn a_broker_signed_by_another_ca_is_refused_and_nothing_is_published() {
    let (theirs, ours) = (TestCa::new("impostor-ca"), TestCa::new("amqp-ca"));
    let tls_broker = TlsBroker::start(&theirs).await;
    let app = TestApp::spawn().await;
    let ids = common::stage_jobs(&app.pool, 1).await;
    let topology = workers::topology::Topology::from_prefix(
        &format!("test-{}", uuid::Uuid::new_v4().simple()),
        5,
    );

    let wrong_ca = tls_broker.url_trusting(&ours);
    let error = workers::amqp::connect(&wrong_ca).await.unwrap_err();
    assert!(
        error.to_string().to_lowercase().contains("certificate"),
        "refused for its certificate: {error}"
    );
    let mut enqueuer = Enqueuer::new(
        app.pool.clone(),
        &wrong_ca,
        topology.clone(),
        common::enqueuer_config(100),
    );
    assert!(enqueuer.run_once().await.is_err());
    assert_eq!(
        common::staged_ids(&app.pool).await,
        ids,
        "the job stays staged until a broker we trust confirms it"
    );

    let plaintext = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        tls_broker.node.port()
    );
    assert!(
        workers::amqp::connect(&plaintext).await.is_err(),
        "the TLS listener served a plaintext client"
    );

    // Nothing reached the broker: declared now over a trusted connection, the queue the
    // enqueuer would have published to is empty.
    let trusted_url = tls_broker.url_trusting(&theirs);
    let trusted = TestBroker {
        session: AmqpSession::open(&trusted_url, &topology).await.unwrap(),
        topology,
        url: trusted_url,
    };
    assert_eq!(trusted.depth(&trusted.topology.receipts_queue).await, 0);
    trusted.cleanup().await;
}
