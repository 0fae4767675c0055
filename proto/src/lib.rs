//! glance-proto: the generated Rust types and tonic stubs for the `glance.v1` gRPC API.
//! The `.proto` files beside this crate are the contract; this crate only compiles them.

#![allow(clippy::all, missing_docs)]

pub mod v1 {
    tonic::include_proto!("glance.v1");

    /// Encoded descriptor set of the public services, for gRPC reflection.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("glance_v1_descriptor");
}
