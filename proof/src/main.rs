//! `proof`: a crash-and-fault campaign against the real Rocket Rides processes on loopback.
//!
//! It starts its own PostgreSQL cluster and RabbitMQ node ([`services`]), fake-stripe, two
//! api-servers (the second with a pool of two connections, to exhaust it), a mail sink, the
//! enqueuer and the receipt worker as separate child processes (plus `completer --once` /
//! `reaper --once` passes), and drives CreateRide with concurrent retrying clients spread over
//! both api-servers. Meanwhile it SIGKILLs the api-servers (at random, and at every crash point
//! of `api_server::fault`) and the workers, stalls an api-server past the lock timeout, restarts
//! PostgreSQL and RabbitMQ, and injects provider faults. Then it drains the system and checks
//! exactly-once charging and receipting against PostgreSQL, fake-stripe's ledger and the mail
//! sink's directory. Any violation is printed with the offending key and makes the process exit
//! non-zero. See docs/reliability.md.

mod args;
mod clients;
mod counters;
mod evidence;
mod faults;
mod invariants;
mod maintenance;
mod processes;
mod replays;
mod services;
mod setup;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use clap::Parser;
use serde_json::json;

use args::Args;
use clients::{Seen, Traffic, User, Window};
use counters::Tallies;
use evidence::{Evidence, Intent, RideRow};
use faults::{Faults, sleep_unless_stopped};
use invariants::Violations;
use maintenance::{Drain, Maintainer};
use processes::{Children, Supervisor};
use replays::Replays;
use services::Services;
use setup::{DbGuard, Plan, Wiring};

#[tokio::main]
async fn main() {
    let args = Args::parse();
    let code = tokio::select! {
        result = campaign(args) => match result {
            Ok(true) => 0,
            Ok(false) => 1,
            Err(error) => {
                eprintln!("proof: error: {error:#}");
                2
            }
        },
        () = interrupted() => {
            eprintln!("proof: interrupted; children are killed on drop");
            130
        }
    };
    // The private servers are daemons, not children: stop them explicitly.
    if code == 130
        && let Some(services) = RUNNING_SERVICES.get()
    {
        services.stop(false).await;
    }
    // Dropping the campaign future above killed every child (kill_on_drop).
    std::process::exit(code);
}

/// Ctrl-C or SIGTERM.
async fn interrupted() {
    let mut term = match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
        Ok(term) => term,
        Err(_) => {
            let _ = tokio::signal::ctrl_c().await;
            return;
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term.recv() => {}
    }
}

/// The private servers of this run, for the interrupt path.
static RUNNING_SERVICES: std::sync::OnceLock<Arc<Services>> = std::sync::OnceLock::new();

async fn campaign(args: Args) -> anyhow::Result<bool> {
    let plan = Plan::new(&args)?;
    setup::check_ports_free(&args).await?;
    let services = setup::start_services(&args, &plan).await?;
    let wiring = Wiring::new(&args, &plan, &services)?;
    println!(
        "proof: run {}, seed {}, {}s of traffic, {} clients, database {}, out {}",
        plan.run_id,
        plan.seed,
        plan.duration.as_secs(),
        args.clients,
        wiring.db_name,
        plan.out_dir.display()
    );
    let services = Arc::new(services);
    let _ = RUNNING_SERVICES.set(Arc::clone(&services));
    let migrated = setup::migrate(&plan.bin_dir, &wiring.env).await;
    if migrated.is_err() {
        services.stop(args.keep).await;
    }
    migrated?;
    let guard = DbGuard::new(&wiring, args.keep);
    let result = run(&args, &plan, &wiring, Arc::clone(&services)).await;
    if services.pg.is_none() {
        guard.cleanup().await;
    }
    services.stop(args.keep).await;
    result
}

#[allow(clippy::too_many_lines)]
async fn run(
    args: &Args,
    plan: &Plan,
    wiring: &Wiring,
    services: Arc<Services>,
) -> anyhow::Result<bool> {
    let mut children = Children::start(args, plan, wiring).await?;
    let users = clients::create_users(args, plan, wiring).await?;
    let tallies = Tallies::default();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .no_proxy()
        .build()?;

    // Traffic and faults.
    let window = Window::from_now(plan.duration);
    let traffic = Traffic::start(args, plan, &users, &tallies, window)?;
    let supervisor = Supervisor::start(&children, &tallies.faults);
    let faults = Faults::start(
        args,
        plan,
        wiring,
        &children,
        &services,
        &tallies.faults,
        &http,
    );
    let maintainer = Maintainer::start(plan, wiring, &tallies.maintenance);
    // Progress.
    let progress = {
        let (requests, stop) = (Arc::clone(&tallies.requests), faults.stopped());
        let faults = Arc::clone(&tallies.faults);
        let traffic_start = window.start;
        tokio::spawn(async move {
            while sleep_unless_stopped(&stop, Duration::from_secs(10)).await {
                let f: u64 = faults.snapshot().values().sum();
                println!(
                    "proof: t+{:>4}s requests {:>6}, fault events {f}",
                    traffic_start.elapsed().as_secs(),
                    AtomicU64::load(&requests, Ordering::Relaxed)
                );
            }
        })
    };
    tokio::time::sleep_until(window.end.into()).await;
    faults.stop().await?;
    let _ = progress.await;
    faults::clear_provider_faults(&http, &wiring.stripe_base).await;
    println!(
        "proof: traffic stopped after {}s; faults off; waiting for clients",
        window.start.elapsed().as_secs()
    );
    children.disarm(&tallies.faults).await?;
    let records = traffic.finish().await?;
    maintainer.stop().await;
    let clients_done = Instant::now();

    // Drains, replays and the evidence, while the children still run.
    let mut conn = schema::connect(&wiring.database_url).await?;
    let drain = maintenance::drain(
        args,
        plan,
        wiring,
        &mut conn,
        &tallies.maintenance,
        clients_done,
    )
    .await?;
    let keys = evidence::load_keys(&mut conn).await?;
    let mut violations = Violations::default();
    let replays = replays::replay(
        args,
        &wiring.grpc_addr,
        &records,
        &keys,
        &users,
        &mut violations,
    )
    .await?;
    let evidence = evidence::collect(&mut conn, keys, &http, plan, wiring).await?;
    drop(conn);

    // Stop every child before judging (the database and ledger are read).
    supervisor.stop().await;
    children.kill_all().await;
    let Evidence {
        keys,
        rides,
        sent_receipts,
        recovered_at_relay,
        claims_left,
        staged_rides,
        attention,
        attention_keys,
        ledger,
        mail,
        unparsed_mail,
    } = evidence;
    let Replays {
        stats: replay_stats,
        seen: replay_seen,
    } = replays;
    let Drain {
        completer: completer_drain,
        receipts: receipts_drain,
        unfinished,
        staged,
    } = drain;
    let Tallies {
        faults,
        attempts,
        maintenance,
        requests,
        retries,
    } = &tallies;
    let key_by_name = evidence::by_name(&keys);
    let token_of: HashMap<i64, &User> = users.iter().map(|u| (u.id, u)).collect();
    let arming = &children.arming;
    let mut v = violations;

    // Indexes.
    let rides_by_key: HashMap<i64, Vec<&RideRow>> =
        rides.iter().fold(HashMap::new(), |mut m, r| {
            if let Some(k) = r.idempotency_key_id {
                m.entry(k).or_insert_with(Vec::new).push(r);
            }
            m
        });
    let ride_by_id: HashMap<i64, &RideRow> = rides.iter().map(|r| (r.id, r)).collect();
    let mut succeeded_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
    let mut all_by_ride: HashMap<i64, Vec<&Intent>> = HashMap::new();
    for pi in &ledger {
        match pi.ride_id {
            Some(ride) => {
                all_by_ride.entry(ride).or_default().push(pi);
                if pi.status == "succeeded" {
                    succeeded_by_ride.entry(ride).or_default().push(pi);
                }
            }
            None => v.add(
                "pi_has_ride",
                format!("PaymentIntent {} has no metadata[ride_id]", pi.id),
            ),
        }
    }
    // Per-ride receipt/charge checks for a ride that must be charged exactly once.
    let check_charged_ride = |v: &mut Violations,
                              key: &str,
                              ride: &RideRow,
                              expected_pi: Option<&str>| {
        let succeeded = succeeded_by_ride
            .get(&ride.id)
            .map_or(&[][..], Vec::as_slice);
        if succeeded.len() != 1 {
            v.add(
                "one_succeeded_pi",
                format!(
                    "key {key}: ride {} has {} succeeded PaymentIntents",
                    ride.id,
                    succeeded.len()
                ),
            );
        }
        if let Some(pi) = succeeded.first() {
            if ride.stripe_charge_id.as_deref() != Some(pi.id.as_str()) {
                v.add(
                    "ride_records_pi",
                    format!(
                        "key {key}: ride {} charge {:?} but PI {}",
                        ride.id, ride.stripe_charge_id, pi.id
                    ),
                );
            }
            if let Some(expected) = expected_pi
                && expected != pi.id
            {
                v.add(
                    "client_saw_pi",
                    format!(
                        "key {key}: client saw charge {expected}, ledger has {}",
                        pi.id
                    ),
                );
            }
        }
        let staged = staged_rides.iter().filter(|r| **r == ride.id).count();
        let receipt = staged + usize::from(sent_receipts.contains(&ride.id));
        if receipt != 1 || staged != 0 {
            v.add(
                "one_receipt",
                format!(
                    "key {key}: ride {}: staged {staged}, sent_receipts {} (want exactly one, mailed)",
                    ride.id,
                    sent_receipts.contains(&ride.id)
                ),
            );
        }
        let mails = mail.get(&ride.id).map_or(&[][..], Vec::as_slice);
        if mails.len() != 1 {
            v.add(
                "one_mail",
                format!("key {key}: ride {} has {} mails", ride.id, mails.len()),
            );
        }
    };
    let check_declined_ride = |v: &mut Violations, key: &str, ride: &RideRow| {
        let all = all_by_ride.get(&ride.id).map_or(0, Vec::len);
        let ok = succeeded_by_ride.get(&ride.id).map_or(0, Vec::len);
        if all > 1 || ok > 0 {
            v.add(
                "declined_once",
                format!(
                    "key {key}: declined ride {} has {all} PaymentIntents ({ok} succeeded)",
                    ride.id
                ),
            );
        }
        if ride.stripe_charge_id.is_some()
            || sent_receipts.contains(&ride.id)
            || mail.contains_key(&ride.id)
        {
            v.add(
                "declined_no_receipt",
                format!(
                    "key {key}: declined ride {} has a charge id, receipt or mail",
                    ride.id
                ),
            );
        }
    };

    // Per key, by what the client finally saw.
    let mut outcomes: BTreeMap<String, u64> = BTreeMap::new();
    let mut abandoned_resolution: BTreeMap<&'static str, u64> = BTreeMap::new();
    for r in &records {
        *outcomes.entry(r.seen.kind().to_owned()).or_default() += 1;
        let row = key_by_name.get(&(r.user_id, r.key.clone()));
        let key_rides = row
            .and_then(|k| rides_by_key.get(&k.id))
            .map_or(&[][..], Vec::as_slice);
        match &r.seen {
            Seen::Ok {
                ride_id, charge_id, ..
            } => {
                if token_of.get(&r.user_id).is_some_and(|u| u.declining) {
                    v.add(
                        "declining_card_never_ok",
                        format!("key {}: declining card succeeded", r.key),
                    );
                }
                match row {
                    Some(k) if k.recovery_point == "finished" => {}
                    _ => v.add(
                        "ok_key_finished",
                        format!(
                            "key {}: client saw OK but key is {:?}",
                            r.key,
                            row.map(|k| &k.recovery_point)
                        ),
                    ),
                }
                if key_rides.len() != 1 {
                    v.add(
                        "one_ride",
                        format!("key {}: {} rides", r.key, key_rides.len()),
                    );
                }
                match key_rides.first() {
                    Some(ride) => {
                        if ride.user_id != r.user_id {
                            v.add(
                                "client_saw_ride",
                                format!(
                                    "key {}: ride {} belongs to user {}",
                                    r.key, ride.id, ride.user_id
                                ),
                            );
                        }
                        if ride.id != *ride_id {
                            v.add(
                                "client_saw_ride",
                                format!(
                                    "key {}: client saw ride {ride_id}, DB has {}",
                                    r.key, ride.id
                                ),
                            );
                        }
                        check_charged_ride(&mut v, &r.key, ride, Some(charge_id));
                    }
                    None => v.add(
                        "one_ride",
                        format!("key {}: client saw ride {ride_id}, no ride in DB", r.key),
                    ),
                }
            }
            Seen::Declined { .. } => {
                if !token_of.get(&r.user_id).is_some_and(|u| u.declining) {
                    v.add(
                        "good_card_never_declined",
                        format!("key {}: good card declined", r.key),
                    );
                }
                match key_rides.first() {
                    Some(ride) => check_declined_ride(&mut v, &r.key, ride),
                    None => v.add(
                        "one_ride",
                        format!("key {}: declined but no ride row", r.key),
                    ),
                }
            }
            Seen::Abandoned(_) | Seen::GaveUp(_) => {
                let listed = attention_keys.contains(&(r.user_id, r.key.clone()));
                match row {
                    None => *abandoned_resolution.entry("never_reached_the_database").or_default() += 1,
                    Some(k) if k.recovery_point == "finished" => {
                        *abandoned_resolution.entry("finished_by_completer_or_server").or_default() += 1;
                        match (replay_seen.get(&r.key), key_rides.first()) {
                            (Some(Seen::Ok { ride_id, charge_id, .. }), Some(ride)) => {
                                if *ride_id != ride.id {
                                    v.add("client_saw_ride", format!("key {}: replay ride {ride_id}, DB {}", r.key, ride.id));
                                }
                                check_charged_ride(&mut v, &r.key, ride, Some(charge_id));
                            }
                            (Some(Seen::Declined { .. }), Some(ride)) => check_declined_ride(&mut v, &r.key, ride),
                            (other, ride) => v.add(
                                "abandoned_resolved",
                                format!("key {}: finished, replay {:?}, ride {:?}", r.key, other.map(Seen::kind), ride.map(|r| r.id)),
                            ),
                        }
                    }
                    Some(_) if listed => *abandoned_resolution.entry("listed_in_keys_needing_attention").or_default() += 1,
                    Some(k) => v.add(
                        "abandoned_resolved",
                        format!("key {} (user {}): unfinished at {} (gave_up {}) and not in keys_needing_attention", r.key, r.user_id, k.recovery_point, k.gave_up),
                    ),
                }
                if let Seen::GaveUp(why) = &r.seen {
                    eprintln!("proof: note: key {} client gave up ({why})", r.key);
                }
            }
            Seen::Unexpected(label) => {
                v.add("no_unexpected_answer", format!("key {}: {label}", r.key))
            }
        }
    }
    // Crash points: every one fired, and the api-servers died of nothing else.
    let crash_points_fired = arming.fired();
    if !args.no_crash_points {
        for point in api_server::fault::CRASH_POINTS {
            if !crash_points_fired.contains_key(*point) {
                v.add(
                    "crash_points_fired",
                    format!("crash point {point} never fired (is the api-server built with the fault-injection feature?)"),
                );
            }
        }
    }
    let fault_counts = faults.snapshot();
    let api_self_exits = fault_counts
        .get("self_exit/api-server")
        .copied()
        .unwrap_or(0)
        + fault_counts
            .get("self_exit/api-server-b")
            .copied()
            .unwrap_or(0);
    let crashes: u64 = crash_points_fired.values().sum();
    if api_self_exits > crashes {
        v.add(
            "no_unexpected_exit",
            format!("the api-servers exited {api_self_exits} times on their own but crash points fired {crashes} times: see logs/api-server*.log"),
        );
    }
    if claims_left > 0 {
        v.add(
            "one_mail",
            format!("{claims_left} receipt claims were never resolved"),
        );
    }
    // Global ledger checks.
    for (ride, pis) in &succeeded_by_ride {
        if pis.len() > 1 {
            v.add(
                "no_double_charge",
                format!(
                    "ride {ride} charged {} times: {}",
                    pis.len(),
                    pis.iter()
                        .map(|p| p.id.as_str())
                        .collect::<Vec<_>>()
                        .join(",")
                ),
            );
        }
        match ride_by_id.get(ride) {
            None => v.add(
                "pi_has_ride",
                format!("succeeded PI(s) for ride {ride} which does not exist"),
            ),
            Some(row) => {
                let listed = row
                    .idempotency_key_id
                    .and_then(|id| keys.iter().find(|k| k.id == id))
                    .is_some_and(|k| {
                        attention_keys.contains(&(k.user_id, k.idempotency_key.clone()))
                    });
                if row.stripe_charge_id.is_none() && !listed {
                    v.add("pi_has_ride", format!("ride {ride} was charged ({}) but records no charge and is not listed for attention", pis[0].id));
                }
            }
        }
    }
    for (ride, stamps) in &mail {
        if !ride_by_id.contains_key(ride) {
            v.add(
                "mail_has_ride",
                format!("{} mails for unknown ride {ride}", stamps.len()),
            );
        }
    }
    if unparsed_mail > 0 {
        v.add(
            "mail_has_ride",
            format!("{unparsed_mail} mails without a ride Message-ID"),
        );
    }
    for ride in &rides {
        if ride.stripe_charge_id.is_some() && !succeeded_by_ride.contains_key(&ride.id) {
            v.add(
                "ride_records_pi",
                format!(
                    "ride {} records charge {:?} the ledger does not hold as succeeded",
                    ride.id, ride.stripe_charge_id
                ),
            );
        }
    }

    // Every key, one JSON line each.
    let keys_jsonl: String = records
        .iter()
        .map(|r| {
            json!({"key": r.key, "user_id": r.user_id, "client": r.client, "attempts": r.attempts,
                   "seen": r.seen.kind(), "detail": r.seen.detail()})
            .to_string()
                + "\n"
        })
        .collect();
    std::fs::write(plan.out_dir.join("keys.jsonl"), keys_jsonl)?;

    // Report.
    let total = plan.started.elapsed();
    let invariants = [
        (
            "ok_key_finished",
            "every key a client saw succeed is finished",
        ),
        ("one_ride", "exactly one ride per key"),
        (
            "client_saw_ride",
            "the ride the client saw is the ride in the database",
        ),
        (
            "one_succeeded_pi",
            "exactly one succeeded PaymentIntent per charged ride",
        ),
        (
            "client_saw_pi",
            "the charge the client saw is the one in the ledger",
        ),
        (
            "ride_records_pi",
            "the ride records the ledger's PaymentIntent",
        ),
        (
            "one_receipt",
            "exactly one receipt (staged or sent) per charged ride, all drained",
        ),
        (
            "one_mail",
            "exactly one mail per charged ride, no claim left",
        ),
        (
            "crash_points_fired",
            "every api-server crash point fired at least once",
        ),
        (
            "no_unexpected_exit",
            "api-servers exited only at crash points or by our kills",
        ),
        (
            "no_double_charge",
            "no ride has two succeeded PaymentIntents",
        ),
        ("pi_has_ride", "no succeeded PaymentIntent without its ride"),
        ("mail_has_ride", "no mail for an unknown ride"),
        (
            "abandoned_resolved",
            "every abandoned key is finished or in keys_needing_attention",
        ),
        (
            "replay_identical",
            "replays are byte-identical to the first final answer",
        ),
        ("replay_marked", "replays carry idempotent-replayed: true"),
        ("replay_final", "finished keys replay a final answer"),
        (
            "declined_once",
            "declined rides: at most one PaymentIntent, none succeeded",
        ),
        (
            "declined_no_receipt",
            "declined rides: no charge id, receipt or mail",
        ),
        ("declining_card_never_ok", "declining cards never succeed"),
        ("good_card_never_declined", "good cards are never declined"),
        (
            "no_unexpected_answer",
            "no non-retryable error other than CARD_DECLINED",
        ),
    ];
    let mut invariant_json = serde_json::Map::new();
    for (id, _) in &invariants {
        invariant_json.insert(
            (*id).to_owned(),
            json!(v.by_invariant.get(id).copied().unwrap_or(0)),
        );
    }
    let passed = v.list.is_empty();
    let attention_by_reason = attention
        .iter()
        .fold(BTreeMap::<String, u64>::new(), |mut m, a| {
            *m.entry(a.reason.clone()).or_default() += 1;
            m
        });
    let report = json!({
        "run_id": plan.run_id,
        "seed": plan.seed,
        "mode": if args.long { "long" } else { "short" },
        "database": wiring.db_name,
        "traffic_secs": plan.duration.as_secs(),
        "total_secs": (total.as_secs_f64() * 10.0).round() / 10.0,
        "clients": args.clients,
        "declining_clients": args.declined_clients,
        "keys": records.len(),
        "requests": AtomicU64::load(requests, Ordering::Relaxed),
        "retries": AtomicU64::load(retries, Ordering::Relaxed),
        "outcomes_seen_by_clients": outcomes,
        "attempt_answers": attempts.snapshot(),
        "abandoned_keys": abandoned_resolution,
        "faults_injected": faults.snapshot(),
        "maintenance": maintenance.snapshot(),
        "drain": {
            "completer_secs": (completer_drain.as_secs_f64() * 10.0).round() / 10.0,
            "receipts_secs": (receipts_drain.as_secs_f64() * 10.0).round() / 10.0,
            "unfinished_keys_left": unfinished,
            "staged_jobs_left": staged,
        },
        "evidence": {
            "rides": rides.len(),
            "charged_rides": rides.iter().filter(|r| r.stripe_charge_id.is_some()).count(),
            "payment_intents": ledger.len(),
            "succeeded_payment_intents": ledger.iter().filter(|p| p.status == "succeeded").count(),
            "sent_receipts": sent_receipts.len(),
            "mails": mail.values().map(Vec::len).sum::<usize>(),
            "receipts_recorded_from_the_relay_search": recovered_at_relay,
            "receipt_claims_left": claims_left,
            "crash_points_fired": crash_points_fired,
            "keys_needing_attention": attention_by_reason,
        },
        "replays": replay_stats,
        "invariant_violations": invariant_json,
        "violations": v.list.iter().take(200).collect::<Vec<_>>(),
        "passed": passed,
    });
    let mut text = String::new();
    let line = |text: &mut String, k: &str, val: String| {
        text.push_str(&format!("{k:<58} {val}\n"));
    };
    text.push_str(&format!(
        "Rocket Rides proof campaign {} (seed {}, {} mode)\n",
        plan.run_id,
        plan.seed,
        if args.long { "long" } else { "short" }
    ));
    line(
        &mut text,
        "traffic / total duration",
        format!("{}s / {:.1}s", plan.duration.as_secs(), total.as_secs_f64()),
    );
    line(
        &mut text,
        "clients (declining cards)",
        format!("{} ({})", args.clients, args.declined_clients),
    );
    line(&mut text, "keys", records.len().to_string());
    line(
        &mut text,
        "requests (attempts)",
        AtomicU64::load(requests, Ordering::Relaxed).to_string(),
    );
    line(
        &mut text,
        "retries",
        AtomicU64::load(retries, Ordering::Relaxed).to_string(),
    );
    text.push_str("-- outcomes seen by clients\n");
    for (k, n) in &outcomes {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- abandoned / given-up keys\n");
    for (k, n) in &abandoned_resolution {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- answers per attempt\n");
    for (k, n) in attempts.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- faults injected\n");
    for (k, n) in faults.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- completer / reaper passes\n");
    for (k, n) in maintenance.snapshot() {
        line(&mut text, &format!("  {k}"), n.to_string());
    }
    text.push_str("-- evidence\n");
    for (k, val) in report["evidence"].as_object().into_iter().flatten() {
        line(&mut text, &format!("  {k}"), val.to_string());
    }
    for (k, val) in report["drain"].as_object().into_iter().flatten() {
        line(&mut text, &format!("  drain.{k}"), val.to_string());
    }
    for (k, val) in &replay_stats {
        line(&mut text, &format!("  replays.{k}"), val.to_string());
    }
    text.push_str("-- invariants\n");
    for (id, what) in &invariants {
        let n = v.by_invariant.get(id).copied().unwrap_or(0);
        line(
            &mut text,
            &format!("  {what}"),
            if n == 0 {
                "PASS".to_owned()
            } else {
                format!("FAIL ({n})")
            },
        );
    }
    text.push_str(&format!(
        "RESULT: {}\n",
        if passed { "PASS" } else { "FAIL" }
    ));
    println!("\n{text}");
    std::fs::write(
        plan.out_dir.join("report.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    std::fs::write(plan.out_dir.join("report.txt"), &text)?;
    if !v.list.is_empty() {
        std::fs::write(plan.out_dir.join("violations.txt"), v.list.join("\n"))?;
    }
    println!("proof: report in {}", plan.out_dir.display());
    Ok(passed)
}
