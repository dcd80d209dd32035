//! The wait's bounds and polling, without a database.

use super::*;

const CONFIG: WaitConfig = WaitConfig {
    max: Duration::from_secs(31),
    per_key: 2,
    per_process: 3,
};

#[test]
fn the_wait_ends_before_the_deadline_and_within_what_was_asked() {
    let now = Instant::now();
    let ends =
        |requested, deadline| wait_until(CONFIG, now, requested, deadline).map(|until| until - now);
    assert_eq!(
        ends(None, Duration::from_secs(120)),
        Some(Duration::from_secs(31))
    );
    assert_eq!(
        ends(None, Duration::from_millis(100)),
        Some(Duration::from_millis(80))
    );
    assert_eq!(
        ends(Some(Duration::from_millis(300)), Duration::from_secs(5)),
        Some(Duration::from_millis(300))
    );
    assert_eq!(ends(Some(Duration::ZERO), Duration::from_secs(5)), None);
    assert_eq!(ends(None, Duration::from_millis(15)), None);
    let off = WaitConfig {
        max: Duration::ZERO,
        ..CONFIG
    };
    assert_eq!(wait_until(off, now, None, Duration::from_secs(5)), None);
}

fn key(n: u8) -> IdempotencyKey {
    IdempotencyKey::parse(&format!("wait-test-key-000000{n}")).unwrap()
}

#[test]
fn waiters_are_bounded_per_key_and_per_process_and_forgotten_when_gone() {
    let waits = Waits::new(CONFIG);
    let first = waits.join(1, &key(1)).unwrap();
    let _second = waits.join(1, &key(1)).unwrap();
    assert!(waits.join(1, &key(1)).is_none(), "per key");
    let _third = waits.join(1, &key(2)).unwrap();
    assert!(waits.join(2, &key(3)).is_none(), "per process");
    drop(first);
    let _again = waits.join(2, &key(3)).unwrap();
    assert_eq!(waits.locked().keys.len(), 3);
    drop((_second, _third, _again));
    let inner = waits.locked();
    assert!(inner.keys.is_empty());
    assert_eq!(inner.waiting, 0);
}

#[tokio::test]
async fn a_holder_tells_its_waiters_how_it_ended() {
    let waits = Waits::new(CONFIG);
    let holding = waits.hold(1, &key(1));
    let mut waiter = waits.join(1, &key(1)).unwrap();
    assert!(
        waits.next_poll(&waiter.id).is_none(),
        "no polls with a holder here"
    );
    let stored = StoredResponse {
        code: 0,
        body: serde_json::json!({"outcome": "x"}).into(),
    };
    holding.finished(|| stored.clone());
    waiter.news.changed().await.unwrap();
    assert!(matches!(&*waiter.news.borrow(), News::Finished(s) if *s == stored));

    let holding = waits.hold(1, &key(1));
    waiter.news.changed().await.unwrap();
    drop(holding);
    waiter.news.changed().await.unwrap();
    assert!(matches!(&*waiter.news.borrow(), News::Free));
    assert!(
        waits.next_poll(&waiter.id).is_some(),
        "polls once no holder is here"
    );
}

#[test]
fn a_holder_nobody_waits_for_builds_no_answer() {
    let waits = Waits::new(CONFIG);
    waits
        .hold(1, &key(1))
        .finished(|| panic!("built an answer for nobody"));
    drop(waits.hold(1, &key(2)));
    assert!(waits.locked().keys.is_empty());

    let holding = waits.hold(1, &key(1));
    let waiter = waits.join(1, &key(1)).unwrap();
    let built = std::cell::Cell::new(false);
    holding.finished(|| {
        built.set(true);
        StoredResponse {
            code: 0,
            body: serde_json::json!({"outcome": "x"}).into(),
        }
    });
    assert!(built.get(), "a waiter hears the answer");
    assert!(matches!(&*waiter.news.borrow(), News::Finished(_)));
    drop(waiter);
    assert!(waits.locked().keys.is_empty());
}

#[test]
fn one_poll_per_gap_among_the_waiters_of_a_key() {
    let waits = Waits::new(CONFIG);
    let first = waits.join(1, &key(1)).unwrap();
    let _second = waits.join(1, &key(1)).unwrap();
    {
        let mut inner = waits.locked();
        inner.keys.get_mut(&first.id).unwrap().next_poll = Instant::now();
    }
    assert!(waits.take_poll(&first.id));
    assert!(!waits.take_poll(&first.id), "the next poll is a gap away");
    let inner = waits.locked();
    assert_eq!(inner.keys[&first.id].poll_gap, FIRST_POLL * 2);
}
