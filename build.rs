//! Compiles the kubelet's plugin APIs (proto/, written for this project from the documented facts) with protox, a
//! pure-Rust protobuf compiler, so that building needs no system `protoc`.

fn main() -> Result<(), Box<dyn std::error::Error>> {
    const PROTOS: [&str; 5] = [
        "proto/pluginregistration/v1/api.proto",
        "proto/dra/v1/api.proto",
        "proto/dra/v1beta1/api.proto",
        "proto/dra-health/v1/api.proto",
        "proto/dra-health/v1alpha1/api.proto",
    ];
    for proto in PROTOS {
        println!("cargo:rerun-if-changed={proto}");
    }
    let descriptors = protox::compile(PROTOS, ["proto"])?;
    tonic_prost_build::configure().build_client(true).build_server(true).compile_fds(descriptors)?;
    Ok(())
}
