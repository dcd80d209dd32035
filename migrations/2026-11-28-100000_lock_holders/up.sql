-- Who holds a key's lock, so that a claim can tell a dead holder from a live one without waiting
-- for the lock timeout.
--
-- A process that takes key locks (the api-server) holds, for as long as it is connected, a
-- session-level advisory lock on a random 64-bit holder id, on a connection of its own
-- (`schema::liveness`); every lock it takes names that id in `lock_holder`. PostgreSQL releases a
-- session's advisory locks the moment the session ends: the process was killed (its socket
-- closed), its connection was terminated, or the server restarted or failed over. A claim asks
-- whether the holder is gone by trying to take the same lock in share mode for its own
-- transaction: that succeeds only if no session holds it.
ALTER TABLE idempotency_keys ADD COLUMN lock_holder BIGINT;

-- A holder names a lock: an unlocked key has none.
ALTER TABLE idempotency_keys ADD CONSTRAINT idempotency_keys_holder_needs_lock
    CHECK (lock_holder IS NULL OR lock_token IS NOT NULL);

-- A server from before holder ids takes and releases locks without naming a holder: its session
-- does not declare `rocket_rides.lock_holders = 'named'` (set by the `schema` crate on every
-- connection of this version), so when it changes a key's lock token the holder of the lock it
-- replaced is forgotten, and its own lock is judged by the lock timeout alone, as before.
CREATE FUNCTION forget_lock_holder_for_servers_without_holders() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    NEW.lock_holder := NULL;
    RETURN NEW;
END
$$;

CREATE TRIGGER forget_lock_holder_for_servers_without_holders
    BEFORE UPDATE OF lock_token ON idempotency_keys
    FOR EACH ROW
    WHEN (NEW.lock_token IS DISTINCT FROM OLD.lock_token
          AND current_setting('rocket_rides.lock_holders', true) IS DISTINCT FROM 'named')
    EXECUTE FUNCTION forget_lock_holder_for_servers_without_holders();

-- Whether the liveness session of `lock_holder` has ended: a share-mode try of its advisory lock
-- succeeds only if no session holds it. The try lock is held to the end of the caller's
-- transaction and blocks nothing but a session taking that holder id, which no live process uses
-- once its own session has ended. `workers admin key show` asks it directly.
CREATE FUNCTION lock_holder_is_gone(lock_holder BIGINT) RETURNS BOOLEAN
LANGUAGE sql VOLATILE AS $$
    SELECT pg_try_advisory_xact_lock_shared(lock_holder)
$$;

-- The one rule for whether a key's lock may be taken over, for every process that judges one
-- (the claim, a waiting duplicate, the completer, the reaper, `workers admin`):
--   'free'        no lock;
--   'expired'     locked at least `lock_timeout_secs` ago;
--   'holder_gone' locked by a holder whose session has ended, on a key created less than
--                 `holder_takeover_secs` ago (a key older than that may be charged after a
--                 search of the provider instead of under its idempotency key, which is safe only
--                 while no other attempt can be charging: it keeps the full lock timeout);
--   'live'        anything else: leave it to its holder.
CREATE FUNCTION idempotency_lock_state(
    locked_at TIMESTAMPTZ,
    lock_holder BIGINT,
    key_created_at TIMESTAMPTZ,
    lock_timeout_secs DOUBLE PRECISION,
    holder_takeover_secs DOUBLE PRECISION
) RETURNS TEXT
LANGUAGE sql VOLATILE AS $$
    SELECT CASE
        WHEN locked_at IS NULL THEN 'free'
        WHEN locked_at <= now() - make_interval(secs => lock_timeout_secs) THEN 'expired'
        WHEN lock_holder IS NOT NULL
             AND key_created_at > now() - make_interval(secs => holder_takeover_secs)
             AND lock_holder_is_gone(lock_holder) THEN 'holder_gone'
        ELSE 'live'
    END
$$;
