include!("../../build-support/link_libtorch.rs");

fn main() {
    link_libtorch();
}
