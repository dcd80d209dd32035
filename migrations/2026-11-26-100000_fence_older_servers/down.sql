DROP TRIGGER IF EXISTS fence_servers_without_deployment_ids ON idempotency_keys;
DROP FUNCTION IF EXISTS refuse_lock_to_servers_without_deployment_ids();
