//! Compiles `glance/v1/*.proto` with the vendored protoc unless `PROTOC` is set.
fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut config = prost_build::Config::new();
    match std::env::var_os("PROTOC") {
        Some(path) => config.protoc_executable(path),
        None => config.protoc_executable(protoc_bin_vendored::protoc_bin_path()?),
    };
    let out = std::path::PathBuf::from(std::env::var("OUT_DIR")?);
    let protos = ["glance/v1/generate.proto", "glance/v1/drafter.proto"];
    for p in protos {
        println!("cargo:rerun-if-changed={p}");
    }
    tonic_prost_build::configure()
        .file_descriptor_set_path(out.join("glance_v1_descriptor.bin"))
        .compile_with_config(config, &protos, &["."])?;
    Ok(())
}
