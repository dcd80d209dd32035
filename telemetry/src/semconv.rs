//! OpenTelemetry semantic-convention names for every process's spans and metrics.
//!
//! Attribute and metric names come from the `opentelemetry-semantic-conventions` crate, which is
//! generated from the specification (RPC, messaging and the database client's pool metrics are
//! still "Development" there, hence its `semconv_experimental` feature): emitters write
//! `{ attribute::RPC_METHOD } = …` in a span and `attr(attribute::RPC_METHOD, …)` on a metric,
//! never the string. The crate generates names only, not the values an attribute takes, so the
//! few values this system sets are spelled here, once.

pub use opentelemetry_semantic_conventions::{attribute, metric};

/// `rpc.system.name` of every call, served or made.
pub const RPC_SYSTEM_GRPC: &str = "grpc";

/// `messaging.system` of the job queue.
pub const MESSAGING_SYSTEM_RABBITMQ: &str = "rabbitmq";

/// `db.system.name` of the one database.
pub const DB_SYSTEM_POSTGRESQL: &str = "postgresql";

/// `messaging.operation.type` of a publish.
pub const MESSAGING_OPERATION_SEND: &str = "send";
/// `messaging.operation.type` of a delivery's handling.
pub const MESSAGING_OPERATION_PROCESS: &str = "process";

/// `messaging.operation.name` of a publish: RabbitMQ's own name for it (`basic.publish`).
pub const RABBITMQ_PUBLISH: &str = "publish";
/// `messaging.operation.name` of a delivery's handling.
pub const RABBITMQ_PROCESS: &str = "process";

/// A gRPC status code as `rpc.response.status_code` carries it: the code's name (`OK`,
/// `UNAVAILABLE`), as the gRPC conventions spell it. A code outside gRPC's 17 is `UNKNOWN`, as a
/// gRPC client reads one.
pub fn grpc_status_code(code: i32) -> &'static str {
    const NAMES: [&str; 17] = [
        "OK",
        "CANCELLED",
        "UNKNOWN",
        "INVALID_ARGUMENT",
        "DEADLINE_EXCEEDED",
        "NOT_FOUND",
        "ALREADY_EXISTS",
        "PERMISSION_DENIED",
        "RESOURCE_EXHAUSTED",
        "FAILED_PRECONDITION",
        "ABORTED",
        "OUT_OF_RANGE",
        "UNIMPLEMENTED",
        "INTERNAL",
        "UNAVAILABLE",
        "DATA_LOSS",
        "UNAUTHENTICATED",
    ];
    usize::try_from(code)
        .ok()
        .and_then(|index| NAMES.get(index))
        .copied()
        .unwrap_or("UNKNOWN")
}

/// A messaging span's name, `{operation} {destination}`, or the operation alone when the
/// destination is empty (RabbitMQ's default exchange).
pub fn messaging_span_name(operation: &str, destination: &str) -> String {
    if destination.is_empty() {
        operation.to_owned()
    } else {
        format!("{operation} {destination}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn grpc_codes_are_named_as_the_conventions_spell_them() {
        assert_eq!(grpc_status_code(0), "OK");
        assert_eq!(grpc_status_code(14), "UNAVAILABLE");
        assert_eq!(grpc_status_code(16), "UNAUTHENTICATED");
        assert_eq!(grpc_status_code(17), "UNKNOWN");
        assert_eq!(grpc_status_code(-1), "UNKNOWN");
    }

    #[test]
    fn the_crate_spells_the_names_the_rules_read() {
        assert_eq!(attribute::RPC_SYSTEM_NAME, "rpc.system.name");
        assert_eq!(
            attribute::RPC_RESPONSE_STATUS_CODE,
            "rpc.response.status_code"
        );
        assert_eq!(metric::RPC_SERVER_CALL_DURATION, "rpc.server.call.duration");
        assert_eq!(
            attribute::DB_CLIENT_CONNECTION_POOL_NAME,
            "db.client.connection.pool.name"
        );
        assert_eq!(messaging_span_name("publish", "rides"), "publish rides");
        assert_eq!(messaging_span_name("publish", ""), "publish");
    }
}
