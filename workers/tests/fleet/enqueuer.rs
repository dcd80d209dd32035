//! The transactionally-staged job drain: the drain itself (one module) and what it does with jobs
//! the broker cannot route yet (another).

mod drain;
mod unroutable;

use crate::common;

fn ids(taken: &[common::Taken]) -> Vec<i64> {
    taken
        .iter()
        .map(|t| t.message_id.parse().unwrap())
        .collect()
}
