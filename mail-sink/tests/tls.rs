//! The sink's TLS as a client sees it on the wire: STARTTLS offered only with a certificate, AUTH
//! offered only inside TLS and refused (and recorded) outside it, and nothing pipelined after
//! STARTTLS taken as said over TLS.

#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

use base64::Engine;
use mail_sink::{Login, MailSink, Retention, SinkTls};
use tokio::{
    io::{AsyncBufReadExt, AsyncWriteExt, BufReader},
    net::TcpStream,
};

fn certificate() -> SinkTls {
    let key = rcgen::KeyPair::generate().unwrap();
    let params = rcgen::CertificateParams::new(vec!["127.0.0.1".to_owned()]).unwrap();
    let cert = params.self_signed(&key).unwrap();
    SinkTls::from_pem(cert.pem().as_bytes(), key.serialize_pem().as_bytes()).unwrap()
}

async fn sink(tls: Option<SinkTls>) -> MailSink {
    MailSink::spawn_with_tls(
        "127.0.0.1:0".parse().unwrap(),
        None,
        Retention::default(),
        tls,
    )
    .await
    .unwrap()
}

struct Client {
    conn: BufReader<TcpStream>,
}

impl Client {
    async fn connect(sink: &MailSink) -> Client {
        let mut client = Client {
            conn: BufReader::new(TcpStream::connect(sink.addr()).await.unwrap()),
        };
        assert!(client.reply().await.starts_with("220 "));
        client
    }

    /// One reply, every line of it; empty once the server has closed the connection.
    async fn reply(&mut self) -> String {
        let mut reply = String::new();
        loop {
            let mut line = String::new();
            if self.conn.read_line(&mut line).await.unwrap() == 0 {
                return reply;
            }
            reply.push_str(&line);
            if line.as_bytes().get(3) != Some(&b'-') {
                return reply;
            }
        }
    }

    async fn say(&mut self, text: &str) -> String {
        self.conn.write_all(text.as_bytes()).await.unwrap();
        self.reply().await
    }
}

#[tokio::test]
async fn starttls_is_offered_with_a_certificate_and_auth_only_inside_tls() {
    let with_tls = sink(Some(certificate())).await;
    let mut client = Client::connect(&with_tls).await;
    let ehlo = client.say("EHLO test\r\n").await;
    assert!(ehlo.contains("STARTTLS"), "{ehlo}");
    assert!(!ehlo.contains("AUTH"), "{ehlo}");
    let credentials = base64::engine::general_purpose::STANDARD.encode(b"\0rides\0s3cret");
    let refused = client.say(&format!("AUTH PLAIN {credentials}\r\n")).await;
    assert!(refused.starts_with("538 "), "{refused}");
    // Refused, but sent: the sink says so, for the tests that must prove it never happens.
    assert_eq!(
        with_tls.logins(),
        [Login {
            user: "rides".to_owned(),
            over_tls: false
        }]
    );

    let without = sink(None).await;
    let mut client = Client::connect(&without).await;
    let ehlo = client.say("EHLO test\r\n").await;
    assert!(!ehlo.contains("STARTTLS"), "{ehlo}");
    assert!(client.say("STARTTLS\r\n").await.starts_with("502 "));
    assert!(
        without
            .serve_smtps("127.0.0.1:0".parse().unwrap())
            .await
            .is_err(),
        "no smtps without a certificate"
    );
}

#[tokio::test]
async fn commands_pipelined_after_starttls_are_refused_not_taken_as_encrypted() {
    let with_tls = sink(Some(certificate())).await;
    let mut client = Client::connect(&with_tls).await;
    client.say("EHLO test\r\n").await;
    let refused = client
        .say("STARTTLS\r\nMAIL FROM:<injected@example.com>\r\n")
        .await;
    assert!(refused.starts_with("501 "), "{refused}");
    assert_eq!(client.reply().await, "", "the sink hangs up");
    assert!(with_tls.received().is_empty());
}
