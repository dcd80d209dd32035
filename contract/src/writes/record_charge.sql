-- Records each key's charge and finishes the key, in one commit: the PaymentIntent id on the
-- key's ride, the receipt job staged (when `stage_receipts` says so: an operator finishing a key
-- whose receipt is already staged or sent stages none), and the key finished with its stored
-- outcome and unlocked. Nothing lies outside the database between recording a charge and
-- staging its receipt, so they need no commit between them; the one commit waits for the WAL
-- flush, as `finished` must be durable before the answer. A key whose fence fails (see
-- `contract::writes`), or whose ride already carries another charge, writes nothing and comes
-- back as no row, while the other keys of the batch commit.
WITH input AS (
    SELECT * FROM unnest(
        $key_ids::int8[], $tokens::uuid[], $user_ids::int8[], $from_points::text[],
        $charge_ids::text[], $ride_ids::int8[], $stage_receipts::bool[],
        $job_names::text[], $job_args::jsonb[], $trace_contexts::jsonb[],
        $response_codes::int4[], $response_bodies::jsonb[]
    ) AS i (key_id, token, user_id, from_point, charge_id, ride_id, stage_receipt,
            job_name, job_args, trace_context, response_code, response_body)
),
fence AS (
    SELECT input.*
    FROM (SELECT * FROM input ORDER BY key_id) input
    CROSS JOIN LATERAL (
        SELECT FROM idempotency_keys
        WHERE idempotency_keys.id = input.key_id
          AND idempotency_keys.lock_token = input.token
          AND idempotency_keys.user_id = input.user_id
          AND idempotency_keys.recovery_point = input.from_point
        FOR NO KEY UPDATE
    ) locked
),
charged AS (
    UPDATE rides SET stripe_charge_id = fence.charge_id
    FROM fence
    WHERE rides.id = ANY(ARRAY(SELECT ride_id FROM fence))
      AND rides.id = fence.ride_id
      AND rides.user_id = fence.user_id
      AND rides.idempotency_key_id = fence.key_id
      AND (rides.stripe_charge_id IS NULL OR rides.stripe_charge_id = fence.charge_id)
    RETURNING rides.idempotency_key_id AS key_id
),
settled AS (
    SELECT fence.* FROM fence JOIN charged USING (key_id)
),
-- A data-modifying CTE runs to completion whether or not anything reads it, and the statement
-- commits all of its writes or none.
job AS (
    INSERT INTO staged_jobs (job_name, job_args, trace_context)
    SELECT job_name, job_args, trace_context FROM settled
    WHERE stage_receipt
    ORDER BY key_id
)
UPDATE idempotency_keys
SET recovery_point = 'finished',
    response_code = settled.response_code,
    response_body = settled.response_body,
    locked_at = NULL, lock_token = NULL, lock_holder = NULL
FROM settled
WHERE idempotency_keys.id = ANY(ARRAY(SELECT key_id FROM settled))
  AND idempotency_keys.id = settled.key_id
  AND idempotency_keys.user_id = settled.user_id
RETURNING idempotency_keys.id, settled.token
