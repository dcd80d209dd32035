//! 4 MiB messages to every service the port serves (health, both reflection versions, both
//! RideService methods), 8 callers per method on 8 connections, without a token. Every one must
//! be refused by the 16 KiB cap from the message's length prefix, before the server buffers it.

use std::{
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::Duration,
};

use futures_util::future::join_all;
use prost_types::Any;
use serde_json::{Value, json};
use tonic::{codegen::http::uri::PathAndQuery, transport::Channel};

use super::{Tally, Target, add, merge, source};
use crate::traffic::label;

const METHODS: [&str; 6] = [
    "/grpc.health.v1.Health/Check",
    "/grpc.health.v1.Health/Watch",
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo",
    "/rides.v1.RideService/CreateRide",
    "/rides.v1.RideService/GetRide",
];
const CALLERS_PER_METHOD: usize = 8;
const SIZE: usize = 4 << 20;

async fn caller(
    channel: Channel,
    method: &'static str,
    message: Arc<Any>,
    stop: Arc<AtomicBool>,
) -> Tally {
    let mut tally = Tally::new();
    let path = PathAndQuery::from_static(method);
    while !stop.load(Ordering::SeqCst) {
        let mut grpc = tonic::client::Grpc::new(channel.clone());
        if grpc.ready().await.is_err() {
            add(&mut tally, format!("{method} CLIENT/NOT_READY"));
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        let codec = tonic_prost::ProstCodec::<Any, Any>::default();
        let request = tonic::Request::new(Any::clone(&message));
        let outcome = match grpc
            .unary::<Any, Any, _>(request, path.clone(), codec)
            .await
        {
            Ok(_) => "OK".to_owned(),
            Err(status) => label(&status),
        };
        add(&mut tally, format!("{method} {outcome}"));
    }
    tally
}

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    let message = Arc::new(Any {
        type_url: String::new(),
        value: vec![0x61; SIZE],
    });
    let stop = Arc::new(AtomicBool::new(false));
    let mut callers = Vec::new();
    for n in 0..CALLERS_PER_METHOD as u32 {
        let channel = Channel::from_shared(format!("http://{}", target.addr))?
            .connect_timeout(Duration::from_secs(2))
            .timeout(Duration::from_secs(10))
            .local_address(Some(source(30, n).into()))
            .connect_lazy();
        for method in METHODS {
            callers.push(tokio::spawn(caller(
                channel.clone(),
                method,
                Arc::clone(&message),
                Arc::clone(&stop),
            )));
        }
    }
    tokio::time::sleep(Duration::from_secs(target.secs)).await;
    stop.store(true, Ordering::SeqCst);
    let tallies = join_all(callers).await.into_iter().flatten();
    let outcomes = merge(tallies);
    let sent: u64 = outcomes
        .iter()
        .filter(|(outcome, _)| !outcome.contains("CLIENT/"))
        .map(|(_, n)| n)
        .sum();
    Ok(json!({
        "message_bytes": SIZE,
        "calls": sent,
        "mib_sent": (sent as usize * SIZE) >> 20,
        "outcomes": outcomes,
    }))
}
