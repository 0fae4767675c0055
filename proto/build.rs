//! Compiles the public API (`glance/v1`) and the internal drafter protocol (`glance/drafter/v1`)
//! with the vendored protoc unless `PROTOC` is set. Only the public API gets a descriptor set (for
//! the verifier's reflection), so the internal service cannot be listed even without a filter.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let public = "glance/v1/generate.proto";
    let internal = "glance/drafter/v1/drafter.proto";
    for proto in [public, internal] {
        println!("cargo:rerun-if-changed={proto}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("glance_v1_descriptor.bin"))
        .compile_with_config(protoc_config()?, &[public], &["."])?;
    // Tap-state payloads as `bytes::Bytes`: a received payload is a slice of the receive buffer,
    // not a copy of it.
    let mut internal_config = protoc_config()?;
    internal_config.bytes([".glance.drafter.v1.TensorData.data"]);
    tonic_prost_build::configure().compile_with_config(internal_config, &[internal], &["."])?;
    Ok(())
}

fn protoc_config() -> Result<prost_build::Config, Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    match std::env::var_os("PROTOC") {
        Some(path) => config.protoc_executable(path),
        None => config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?),
    };
    Ok(config)
}
