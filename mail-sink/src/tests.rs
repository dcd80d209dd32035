//! The sink's unit tests: address parsing, dot-unstuffing, the retention's bounds and the
//! Message-ID index that follows them, header reading and the search's Message-ID form. Beside
//! lib.rs so that the sink's own code reads whole.

use tokio::io::BufReader;

use super::{search::*, smtp::*, *};

#[test]
fn parses_addresses() {
    assert_eq!(
        address_after("MAIL FROM:<a@b.c> BODY=8BITMIME", "FROM:").as_deref(),
        Some("a@b.c")
    );
    assert_eq!(
        address_after("rcpt to: <x@y>", "TO:").as_deref(),
        Some("x@y")
    );
    assert_eq!(address_after("MAIL FROM:a@b", "FROM:"), None);
}

#[tokio::test]
async fn unstuffs_dots() {
    let input = b"Subject: x\r\n\r\n..leading dot\r\nplain\r\n.\r\n".to_vec();
    let mut reader = BufReader::new(&input[..]);
    let data = read_data(&mut reader).await.unwrap().unwrap();
    assert_eq!(data, "Subject: x\r\n\r\n.leading dot\r\nplain");
}

fn mail(data: &str) -> ReceivedMail {
    ReceivedMail {
        mail_from: String::new(),
        rcpt_to: vec![],
        data: data.into(),
        over_tls: false,
    }
}

fn kept(state: &State) -> Vec<String> {
    state.mails().iter().map(|mail| mail.data.clone()).collect()
}

#[test]
fn keeps_at_most_its_retention_dropping_the_oldest() {
    let state = State {
        retention: Retention {
            max_mails: 2,
            max_bytes: 10,
        },
        ..State::default()
    };
    state.keep(mail("aaa"));
    state.keep(mail("bbb"));
    state.keep(mail("ccc"));
    assert_eq!(kept(&state), ["bbb", "ccc"], "by count");
    state.keep(mail("dddddddd"));
    assert_eq!(kept(&state), ["dddddddd"], "by bytes");
    // A mail larger than the byte limit is not kept at all.
    state.keep(mail("eeeeeeeeeee"));
    assert!(kept(&state).is_empty());
}

#[test]
fn the_message_id_index_follows_what_is_kept() {
    let state = State {
        retention: Retention {
            max_mails: 3,
            max_bytes: 1 << 20,
        },
        ..State::default()
    };
    let with_id = |id: &str| mail(&format!("Message-ID: <{id}>\r\n\r\nbody"));
    for id in ["a@x", "b@x", "a@x", "c@x"] {
        state.keep(with_id(id));
    }
    // The first a@x was dropped (retention 3); the second is the third mail ever (seq 2).
    let kept = state.mails();
    let found: Vec<u64> = kept
        .with_message_id("a@x")
        .iter()
        .map(|(seq, _)| *seq)
        .collect();
    assert_eq!(found, [2]);
    assert_eq!(kept.with_message_id("b@x").len(), 1);
    assert_eq!(
        kept.with_message_id("<c@x>").len(),
        0,
        "ids are looked up bare"
    );
    assert_eq!(
        kept.with_message_id("c@x")[0].1.message_id().as_deref(),
        Some("<c@x>")
    );
    drop(kept);
    for id in ["d@x", "e@x", "f@x"] {
        state.keep(with_id(id));
    }
    let kept = state.mails();
    assert!(kept.with_message_id("a@x").is_empty());
    assert!(kept.with_message_id("c@x").is_empty());
    assert_eq!(
        kept.by_message_id.len(),
        3,
        "dropped mails leave no index entry"
    );
}

#[test]
fn reads_headers() {
    let mail = ReceivedMail {
        mail_from: String::new(),
        rcpt_to: vec![],
        data: "Message-ID: <a@b>\r\nSubject: long\r\n  folded\r\n\r\nMessage-ID: body".into(),
        over_tls: false,
    };
    assert_eq!(mail.message_id().as_deref(), Some("<a@b>"));
    assert_eq!(mail.header("subject").as_deref(), Some("long folded"));
}

#[test]
fn searches_message_ids_without_their_angle_brackets() {
    assert_eq!(bare(" <a@b> "), "a@b");
    assert_eq!(bare("a@b>"), "a@b>");
}
