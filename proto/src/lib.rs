//! The `rides.v1` gRPC contract, generated at build time from `rides/v1/rides.proto`.
//!
//! Both the server (`api-server`) and clients (the completer, the load generator, tests) depend on
//! this crate so that there is exactly one definition of the wire format.

/// Generated messages, `ride_service_client` and `ride_service_server`.
pub mod rides {
    // tonic-build's server dispatch is one `call` with a match arm per method: generated code,
    // not ours to split into steps.
    #[allow(clippy::too_many_lines)]
    pub mod v1 {
        tonic::include_proto!("rides.v1");
    }
}

pub mod client;
pub mod metadata;
pub mod reason;

pub use rides::v1;

/// Encoded `FileDescriptorSet` of the contract (and the well-known types it imports), served by
/// gRPC reflection so that `grpcurl` works without the proto files.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("rides_descriptor");
