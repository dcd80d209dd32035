DROP TABLE refund_audits;
