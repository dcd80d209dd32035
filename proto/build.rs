//! Compiles `rides/v1/rides.proto` with protox (a pure-Rust protobuf compiler, so a fresh machine
//! needs no system `protoc`) and hands the descriptors to tonic-prost-build. The encoded
//! descriptor set is also written to `OUT_DIR` for gRPC server reflection.

use std::{env, fs, path::PathBuf};

use prost::Message;

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let proto = "rides/v1/rides.proto";
    println!("cargo:rerun-if-changed={proto}");
    let descriptors = protox::compile([proto], ["."])?;
    let out_dir = PathBuf::from(env::var("OUT_DIR")?);
    fs::write(
        out_dir.join("rides_descriptor.bin"),
        descriptors.encode_to_vec(),
    )?;
    tonic_prost_build::configure()
        .build_client(true)
        .build_server(true)
        .compile_fds(descriptors)?;
    Ok(())
}
