//! Integration tests of the worker fleet against real PostgreSQL (one database per test) and
//! real RabbitMQ (one uniquely prefixed topology per test). One binary, several modules: one
//! link instead of one per file.
#![allow(clippy::unwrap_used, clippy::expect_used, clippy::panic)]

mod admin;
mod amqp_tls;
mod common;
mod completer;
mod consumer_batches;
mod end_to_end;
mod enqueuer;
mod jobs;
mod reaper;
mod receipt_batches;
mod receipts;
mod receipts_restarts;
mod reconciler;
mod smtp_relay;
mod smtp_tls;
mod tls;
