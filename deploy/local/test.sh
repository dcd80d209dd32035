#!/usr/bin/env bash
# Runs every check the project has: formatting, the house rules (deploy/local/house.sh: no Rust
# file over 500 lines), clippy, the full test suite under nextest
# against real PostgreSQL and RabbitMQ (started or installed here when absent), its ignored tests
# against a private Postfix (deploy/local/smtp-relay-tls.sh; installs postfix when absent; skip it
# with SMTP_RELAY=0), then a two-minute
# soak (bench/soak.sh: every call answered, every ride charged, receipted and mailed once), the short
# crash-and-fault campaign with the money campaign at the production defaults and once with the
# limits lifted (proof/run.sh --short --money [--riders-per-client 250 --production-defaults]; skip it with
# PROOF=0), the rolling-deploy campaign (proof/run.sh --rolling: clients straight to the
# api-servers, then behind HAProxy at the production defaults with rider-shaped callers; installs
# haproxy when absent) and the high-availability smoke
# run: one PostgreSQL primary SIGKILL and one RabbitMQ
# node SIGKILL on the Patroni + 3-node topology of deploy/local/ha.sh (installs patroni and
# etcd-server when absent; skip it with HA=0).
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

# The fixed ports of the processes this run starts, checked before anything starts. PostgreSQL's
# 5432 and RabbitMQ's 5672 are not here: a server answering there is reused.
ports=()
if [[ "${MONITORING_LIVE:-1}" != 0 ]]; then # deploy/monitoring/live-check.sh
  ports+=("19090 live-check's Prometheus" "19051 live-check's api-server" "19111 live-check's fake-stripe"
    "19025 live-check's mail sink" "19026 live-check's mail search")
  for port in 19464 19465 19466 19467 19468 19469; do ports+=("$port live-check's metrics"); done
fi
if [[ "${PROOF:-1}" != 0 ]]; then
  ports+=("25351 the soak's api-server" "25353 the soak's metrics" "12411 the soak's fake-stripe"
    "2825 the soak's mail sink" "8825 the soak's mail search" "25533 the soak's PostgreSQL") # bench/soak.sh
  ports+=("25251 proof's api-server" "25252 proof's second api-server" "25250 proof's HAProxy"
    "12311 proof's fake-stripe" "2625 proof's mail sink" "8626 proof's mail search"
    "25433 proof's PostgreSQL" "5683 proof's RabbitMQ" "25683 proof's RabbitMQ distribution") # proof/src/args.rs
  if [[ "${HA:-1}" != 0 ]]; then # proof --ha: deploy/local/ha.sh with HA_PORT_BASE=27000
    for port in 27379 27380 27432 27433 27008 27009 27672 27673 27674 27682 27683 27684; do
      ports+=("$port the HA topology (etcd, Patroni, PostgreSQL, RabbitMQ)")
    done
  fi
fi
if [[ "${SMTP_RELAY:-1}" != 0 ]]; then # deploy/local/smtp-relay-tls.sh
  ports+=("25587 the relay's STARTTLS port" "25465 the relay's smtps port")
fi
require_free_ports "${ports[@]}"
# What this command builds into target/ (debug: clippy, the tests, the campaigns' fault-injection
# api-server), measured from empty: 9.7 GiB without incremental caches (CI), and with them the
# debug build alone held 15 GiB (docs/reliability.md, "How to run"); about a tenth more is asked for.
if [[ "${CARGO_INCREMENTAL:-}" == 0 ]]; then
  require_free_disk 11 "the test command"
else
  require_free_disk 17 "the test command (with incremental caches; CARGO_INCREMENTAL=0 writes 11 GiB)"
fi

ensure_cargo
ensure_postgres
ensure_rabbitmq
ensure_nextest

log "cargo fmt --check"
cargo fmt --all -- --check
deploy/local/house.sh
log "cargo clippy (warnings are errors)"
cargo clippy --workspace --all-targets --locked -- -D warnings
log "deploy/validate.sh (Dockerfile, compose, Kubernetes manifests, offline)"
deploy/validate.sh
log "deploy/monitoring/test.sh (Prometheus rules: promtool unit tests, then a live scrape)" && deploy/monitoring/test.sh
log "deploy/local/deny.sh (cargo deny: licenses, bans, sources)" && deploy/local/deny.sh
deploy/local/buf-lint.sh
log "cargo nextest run --workspace"
cargo nextest run --workspace --locked --profile "${NEXTEST_PROFILE:-default}" "$@"
if [[ "${SMTP_RELAY:-1}" != 0 ]]; then
  # The suite's three ignored tests: they need this relay, which installs postfix when absent.
  log "deploy/local/smtp-relay-tls.sh (receipts over STARTTLS and implicit TLS to a private Postfix; the suite's ignored tests)"
  deploy/local/smtp-relay-tls.sh
fi
if [[ "${PROOF:-1}" != 0 ]]; then
  # Right after nextest, whose debug binaries it runs (proof/run.sh rebuilds the api-server with
  # its crash points); the hour is docs/reliability.md's "Soak".
  log "bench/soak.sh, short (2 minutes at the production defaults, debug build; invariants and bounds judged)"
  SOAK_PROFILE=debug SOAK_SECS=120 WINDOW_SECS=60 SAMPLE_SECS=10 WARMUP_SECS=10 RIDERS=2000 \
    SOAK_CHARTS=0 SOAK_DRIFT_GOALS=0 bench/soak.sh
fi
if [[ "${PROOF:-1}" != 0 ]]; then
  log "proof/run.sh --short --money at the production defaults, 16 backends carrying 250 riders each (crash-and-fault campaign with the money campaign, about 2 minutes)"
  proof/run.sh --short --money --riders-per-client 250 --production-defaults
  # Beside it, with the limits lifted and a 6 s lock timeout: the one run in which a stalled
  # api-server's locks expire and are taken over during traffic (at the defaults a stall lasts
  # longer than the traffic).
  log "proof/run.sh --short --money, limits lifted (stalled holders' locks expire during traffic; about 90 s)"
  proof/run.sh --short --money
fi
if [[ "${PROOF:-1}" != 0 ]]; then
  log "proof/run.sh --rolling (every api-server and worker replaced three times during traffic; about 2 minutes)"
  proof/run.sh --rolling --duration-secs 45
  log "proof/run.sh --rolling behind HAProxy, at the production defaults, 16 backends carrying 250 riders each over one connection (about 2 minutes)"
  proof/run.sh --rolling --duration-secs 45 --lb --riders-per-client 250 --production-defaults
fi
if [[ "${PROOF:-1}" != 0 && "${HA:-1}" != 0 ]]; then
  # No stall: a stall holds keys for the lock timeout, and its seconds would count against the
  # failover the smoke run judges; the short campaign above runs stalls.
  log "proof/run.sh --ha smoke run (one failover, one broker node kill; about 3 minutes)"
  proof/run.sh --ha --duration-secs 45 --pg-restart-every-secs 1000 --rabbit-restart-every-secs 1000 \
    --switchover-ratio 0 --no-stalls
fi
