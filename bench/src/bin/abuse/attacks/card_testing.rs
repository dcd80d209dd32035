//! Card testing: one authenticated user whose card is declined creates new keys as fast as 8
//! concurrent callers can. The decline budget must cut it off after its budget of declines, so
//! its rows and provider calls stop there however long it goes on.

use serde_json::Value;

use super::{Target, flood, source};

const CALLERS: u32 = 8;

pub async fn run(target: &Target) -> anyhow::Result<Value> {
    flood(target, source(60, 0), &target.tester_token, CALLERS).await
}
