-- An api-server from before deployment ids, serving beside a newer one during a rolling upgrade
-- (or rolled back to), would resume a ride created under a deployment id with the old provider
-- idempotency key (`rocket-rides-{key id}`): the provider would charge it a second time. Every
-- process of this version says on each of its connections that it knows deployment ids
-- (`rocket_rides.provider_keys = 'deployment'`, set by the `schema` crate when it connects); a
-- session that does not is refused the lock of a key whose ride carries a deployment id. The
-- refusal is a serialization failure (SQLSTATE 40001), which every server treats as a transient
-- conflict: its caller retries, reaches a newer server, and nothing is charged twice.
--
-- A key whose ride has no deployment id (an older server's) is not fenced: newer servers resume
-- it under its old provider key. A key with no ride yet has had no charge attempted.
CREATE FUNCTION refuse_lock_to_servers_without_deployment_ids() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF EXISTS (SELECT 1 FROM rides
               WHERE idempotency_key_id = NEW.id AND user_id = NEW.user_id
                 AND deployment_id IS NOT NULL) THEN
        RAISE EXCEPTION 'idempotency key % has a ride created under a deployment id; this '
            'server predates deployment ids and would charge it under another provider key', NEW.id
            USING ERRCODE = '40001',
                  HINT = 'finish the rolling upgrade: servers of this version resume the key';
    END IF;
    RETURN NEW;
END
$$;

-- The WHEN clause is evaluated without calling the function: a session of this version (the
-- setting present) pays one setting lookup per lock taken, nothing more.
CREATE TRIGGER fence_servers_without_deployment_ids
    BEFORE UPDATE OF lock_token ON idempotency_keys
    FOR EACH ROW
    WHEN (NEW.lock_token IS NOT NULL
          AND NEW.lock_token IS DISTINCT FROM OLD.lock_token
          AND current_setting('rocket_rides.provider_keys', true) IS DISTINCT FROM 'deployment')
    EXECUTE FUNCTION refuse_lock_to_servers_without_deployment_ids();
