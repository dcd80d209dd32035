CREATE FUNCTION staged_jobs_notify() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('staged_jobs', '');
    RETURN NULL;
END;
$$;

CREATE TRIGGER staged_jobs_notify
    AFTER INSERT ON staged_jobs
    FOR EACH STATEMENT EXECUTE FUNCTION staged_jobs_notify();
