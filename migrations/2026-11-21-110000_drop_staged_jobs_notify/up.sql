-- NOTIFY takes a database-wide lock from the notifying commit until its WAL is flushed, so a
-- trigger that notifies on every staged job serialises every CreateRide's final commit across the
-- whole server (measured: the top wait at 32 clients, and 13 % of pgbench throughput). The
-- enqueuer polls instead; an idle poll is one indexed query every ENQUEUER_IDLE_MAX_MS.
DROP TRIGGER staged_jobs_notify ON staged_jobs;
DROP FUNCTION staged_jobs_notify();
