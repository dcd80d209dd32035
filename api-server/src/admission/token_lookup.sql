-- The users of cold tokens' digests, for every lookup waiting at once: one row per digest, in the
-- order given, `NULL` where no user has it. `LATERAL … LIMIT 1` keeps the generic plan, which
-- cannot know how many digests a batch holds, one index probe per digest.
SELECT u.id
FROM unnest($digests::bytea[]) WITH ORDINALITY AS d (digest, n)
LEFT JOIN LATERAL (
    SELECT id FROM users WHERE users.api_token_digest = d.digest LIMIT 1
) u ON true
ORDER BY d.n
