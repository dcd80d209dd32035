ALTER TABLE rides DROP COLUMN deployment_id;
