//! glance-proto: the gRPC contracts of glance — the public `glance.v1` API and the internal
//! `glance.drafter.v1` protocol, a package of its own outside the public descriptor set — and, behind the
//! `codec` feature, the wire codec that turns tensors and trees into their messages; and the
//! transport settings both services' servers share.

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

pub mod transport {
    use tokio::net::TcpListener;
    use tonic::transport::server::TcpIncoming;

    /// The connections a server accepts on `listener`, with Nagle's algorithm off. tonic applies
    /// `Server::tcp_nodelay` only to the listeners it binds itself, not to an incoming stream
    /// (`serve_with_incoming*`, which both services use to bind before they announce the port):
    /// without this a reply written in two segments waited on the peer's delayed ACK, 40 ms on
    /// Linux, in about one drafter round in a thousand.
    pub fn accepted_connections(listener: TcpListener) -> TcpIncoming {
        TcpIncoming::from(listener).with_nodelay(Some(true))
    }

    #[cfg(test)]
    mod tests {
        use tokio_stream::StreamExt;

        #[tokio::test]
        async fn accepted_connections_send_without_delay() {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let mut incoming = super::accepted_connections(listener);
            let _client = tokio::net::TcpStream::connect(addr).await.unwrap();
            let accepted = incoming.next().await.expect("a connection").expect("accepted");
            assert!(accepted.nodelay().unwrap(), "Nagle's algorithm is on for an accepted connection");
        }
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
