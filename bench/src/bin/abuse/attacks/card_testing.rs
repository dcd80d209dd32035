//! Card testing: one authenticated user whose card is declined creates new keys as fast as 8
//! concurrent callers can. The decline budget must cut it off after its budget of declines, so
//! its rows and provider calls stop there however long it goes on.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::future::join_all;
use serde_json::{Value, json};

use super::{Tally, Target, add, merge, source};
use crate::traffic::{PARAMS, authorized, client, label};

const CALLERS: u32 = 8;

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let rpc = client(target.addr, Some(source(60, 0).into()))?;
    let stop = Arc::new(AtomicBool::new(false));
    let callers: Vec<_> = (0..CALLERS)
        .map(|_| {
            let (mut rpc, token, stop) =
                (rpc.clone(), target.tester_token.clone(), Arc::clone(&stop));
            tokio::spawn(async move {
                let mut tally = Tally::new();
                while !stop.load(Ordering::SeqCst) {
                    let outcome = match rpc.create_ride(authorized(PARAMS, &token, true)).await {
                        Ok(_) => "OK".to_owned(),
                        Err(status) => label(&status),
                    };
                    add(&mut tally, outcome);
                }
                tally
            })
        })
        .collect();
    tokio::time::sleep(Duration::from_secs(target.secs)).await;
    stop.store(true, Ordering::SeqCst);
    let outcomes = merge(join_all(callers).await.into_iter().flatten());
    Ok(json!({
        "callers": CALLERS,
        "calls": outcomes.values().sum::<u64>(),
        "outcomes": outcomes,
    }))
}
