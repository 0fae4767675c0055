//! glance-proto: the gRPC contracts of glance — the public `glance.v1` API and the internal
//! `glance.drafter.v1` protocol, a package of its own outside the public descriptor set — and, behind the
//! `codec` feature, the wire codec that turns tensors and trees into their messages.

#[allow(clippy::all, missing_docs)]
pub mod v1 {
    tonic::include_proto!("glance.v1");

    /// Encoded descriptor set of the public API, for gRPC reflection. The internal drafter
    /// protocol is not in it.
    pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("glance_v1_descriptor");
}

pub mod drafter {
    /// HTTP/2 flow-control window of the drafter hop, both directions (bytes): rounds carry tap
    /// states, and the 64 KiB default would make them wait on window updates.
    pub const HOP_WINDOW: u32 = 16 << 20;

    #[allow(clippy::all, missing_docs)]
    pub mod v1 {
        tonic::include_proto!("glance.drafter.v1");
    }
}

#[cfg(test)]
mod tests {
    /// Reflection serves this set: the internal protocol must not be in it, filter or not.
    #[test]
    fn the_public_descriptor_set_has_no_internal_service() {
        let has = |needle: &str| {
            super::v1::FILE_DESCRIPTOR_SET.windows(needle.len()).any(|w| w == needle.as_bytes())
        };
        assert!(has("glance.v1") && has("GenerateRequest"));
        assert!(!has("glance.drafter") && !has("DraftRequest") && !has("HandshakeRequest"));
    }
}
