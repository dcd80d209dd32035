-- The deployment a ride was created under (`DEPLOYMENT_ID`, docs/money-safety.md). Its charge's
-- provider idempotency key is namespaced by it (`rocket-rides-{deployment_id}-{key id}`) and its
-- charge's metadata carries it, so that the provider never replays another environment's answer
-- and a PaymentIntent can be proven ours. A charge is only ever attempted after its ride exists,
-- so the ride's column fixes, before the first attempt, what every attempt presents.
--
-- NULL: the ride was created by a server that predates deployment ids, so its charge may already
-- have been attempted under the old provider key (`rocket-rides-{key id}`, no marker in the
-- metadata). Such a ride keeps that provider key and that metadata for every retry, forever (a
-- different key would charge again; different parameters under the same key are refused).
-- Nothing fills the column in for existing rows, on purpose.
ALTER TABLE rides
    ADD COLUMN deployment_id TEXT
        CHECK (deployment_id ~ '^[a-z0-9][a-z0-9-]{0,23}$');
