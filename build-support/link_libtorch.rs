// Shared by the build.rs of every crate that links tch into an executable (binaries and tests).
// rustc links with --as-needed, which drops libtorch_cuda.so (no symbol of it is referenced) and so
// hides every GPU; --no-as-needed -ltorch keeps it. The libtorch directory becomes an rpath so the
// executables run without LD_LIBRARY_PATH.
fn link_libtorch() {
    if let Some(lib_path) = std::env::var_os("DEP_TCH_LIBTORCH_LIB") {
        println!("cargo:rustc-link-arg=-Wl,-rpath={}", lib_path.to_string_lossy());
    }
    println!("cargo:rustc-link-arg=-Wl,--no-as-needed");
    println!("cargo:rustc-link-arg=-ltorch");
    println!("cargo:rerun-if-changed=build.rs");
}
