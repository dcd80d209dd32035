-- One sample of the soak's database (bench/soak.sh): every table's and index's size, live and
-- dead tuples and autovacuum runs, the staged-job backlog and its oldest job's age, and the rows a
-- person would be paged for. One JSON object on one line.
SELECT json_build_object(
  'db_bytes', pg_database_size(current_database()),
  'tables', (SELECT json_object_agg(relname, json_build_object(
      'table_bytes', pg_table_size(relid),
      'index_bytes', pg_indexes_size(relid),
      'live', n_live_tup,
      'dead', n_dead_tup,
      'autovacuums', autovacuum_count,
      'autoanalyzes', autoanalyze_count))
    FROM pg_stat_user_tables WHERE schemaname = 'public'),
  'indexes', (SELECT json_object_agg(indexrelname, pg_relation_size(indexrelid))
    FROM pg_stat_user_indexes WHERE schemaname = 'public'),
  'staged_jobs', (SELECT count(*) FROM staged_jobs),
  'staged_oldest_age_s', (SELECT coalesce(extract(epoch FROM now() - min(created_at)), 0) FROM staged_jobs),
  'keys', (SELECT count(*) FROM idempotency_keys),
  'unfinished_keys', (SELECT count(*) FROM idempotency_keys WHERE recovery_point <> 'finished'),
  'attention_open', (SELECT count(*) FROM keys_needing_attention WHERE resolved_at IS NULL),
  'findings_open', (SELECT count(*) FROM reconciliation_findings WHERE resolved_at IS NULL)
);
