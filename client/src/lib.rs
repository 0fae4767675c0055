//! glance-client: a small Rust client of glance's public gRPC API (`glance.v1.Generation`) — a
//! connection with the server's message limits, and requests built from a prompt, images and
//! decoding options — with the `glance` command line on top. Needs only the proto crate and tonic,
//! not libtorch.

use std::path::Path;

use glance_proto::v1 as pb;
use glance_proto::v1::generation_client::GenerationClient;
use glance_security::{ClientTlsFiles, ClientTlsFlags, SecurityError};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

pub use glance_proto::v1;

/// A decoding mode as the command lines spell it (`glance --mode`, `verifier-svc --default-mode`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Mode {
    /// The server's default.
    Default,
    /// The cost-aware round policy over GLANCE trees.
    Auto,
    /// Plain greedy decoding.
    Autoregressive,
    /// GLANCE: block draft, best-first tree.
    #[value(alias = "speculative-tree")]
    Tree,
    /// Block draft, width-1 chain.
    #[value(alias = "speculative-chain")]
    Chain,
    /// Prompt-lookup n-gram drafts.
    PromptLookup,
}

impl From<Mode> for pb::DecodingMode {
    fn from(mode: Mode) -> Self {
        match mode {
            Mode::Default => Self::Unspecified,
            Mode::Auto => Self::Auto,
            Mode::Autoregressive => Self::Autoregressive,
            Mode::Tree => Self::SpeculativeTree,
            Mode::Chain => Self::SpeculativeChain,
            Mode::PromptLookup => Self::PromptLookup,
        }
    }
}

/// Largest response accepted (the server's own limit on requests).
pub const MAX_MESSAGE_BYTES: usize = 64 * 1024 * 1024;

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("cannot connect to {addr}: {source}")]
    Connect { addr: String, source: tonic::transport::Error },
    #[error("{addr}: {reason}")]
    Address { addr: String, reason: String },
    #[error(transparent)]
    Security(#[from] SecurityError),
    #[error("{path}: {source}")]
    Image { path: String, source: std::io::Error },
}

/// How to reach a verifier-svc: its address (`http://host:port`, or `https://` with `tls`), and
/// the API key it asks for, if any.
#[derive(Clone, Debug, Default)]
pub struct Server {
    pub addr: String,
    pub tls: ClientTlsFiles,
    pub api_key: Option<String>,
}

/// A Generation client that sends the API key with every call.
pub type Client = GenerationClient<InterceptedService<Channel, ApiKeyHeader>>;

/// Adds `authorization: Bearer KEY` to every call (nothing without a key).
#[derive(Clone, Debug)]
pub struct ApiKeyHeader(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl tonic::service::Interceptor for ApiKeyHeader {
    fn call(&mut self, mut request: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(value) = &self.0 {
            request.metadata_mut().insert("authorization", value.clone());
        }
        Ok(request)
    }
}

impl Server {
    /// The flags the `glance` command line reads the TLS files from.
    pub const TLS_FLAGS: ClientTlsFlags =
        ClientTlsFlags { ca: "--tls-ca", cert: "--tls-cert", key: "--tls-key" };

    /// A channel to the server (TLS for an `https` address).
    pub async fn channel(&self) -> Result<Channel, ClientError> {
        let bad = |reason: String| ClientError::Address { addr: self.addr.clone(), reason };
        let endpoint = Endpoint::from_shared(self.addr.clone()).map_err(|e| bad(e.to_string()))?;
        let uri = endpoint.uri().clone();
        let host = uri.host().ok_or_else(|| bad("no host".into()))?;
        let endpoint = match self.tls.config(Self::TLS_FLAGS, uri.scheme_str() == Some("https"), host)? {
            Some(tls) => endpoint.tls_config(tls).map_err(|e| bad(e.to_string()))?,
            None => endpoint,
        };
        endpoint.connect().await.map_err(|source| ClientError::Connect { addr: self.addr.clone(), source })
    }

    /// Connects a Generation client with the server's message limits and the API key.
    pub async fn connect(&self) -> Result<Client, ClientError> {
        let header = match &self.api_key {
            Some(key) => Some(format!("Bearer {key}").parse().map_err(|_| ClientError::Address {
                addr: self.addr.clone(),
                reason: "the API key is not ASCII".into(),
            })?),
            None => None,
        };
        let client = GenerationClient::with_interceptor(self.channel().await?, ApiKeyHeader(header));
        Ok(client.max_decoding_message_size(MAX_MESSAGE_BYTES))
    }
}

/// One user turn (images first, then the text), after an optional system message.
#[derive(Clone, Debug, Default)]
pub struct Request {
    pub system: Option<String>,
    pub prompt: String,
    /// Encoded image files (PNG, JPEG, WebP), in order.
    pub images: Vec<Vec<u8>>,
    pub max_new_tokens: u32,
    pub stop: Vec<String>,
    /// Token ids that end the generation (finish reason STOP).
    pub stop_token_ids: Vec<u32>,
    pub mode: pb::DecodingMode,
    /// 0: the server's default.
    pub tree_budget: u32,
    /// Greedy by default.
    pub sampling: Sampling,
    /// Each token's log-probability with this many alternatives (None: no log-probabilities).
    pub logprobs: Option<u32>,
}

/// The sampling options of a request (see `DecodingOptions` in `glance.v1`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Sampling {
    /// 0: greedy.
    pub temperature: f32,
    /// 0: all tokens.
    pub top_k: u32,
    /// None: 1, all tokens.
    pub top_p: Option<f32>,
    pub min_p: f32,
    /// None: the server picks one (and returns it).
    pub seed: Option<u64>,
}

impl Request {
    /// Reads image files into the request.
    pub fn with_image_files(mut self, paths: &[impl AsRef<Path>]) -> Result<Self, ClientError> {
        for path in paths {
            let path = path.as_ref();
            let data = std::fs::read(path)
                .map_err(|source| ClientError::Image { path: path.display().to_string(), source })?;
            self.images.push(data);
        }
        Ok(self)
    }

    /// The request on the wire.
    pub fn to_proto(&self) -> pb::GenerateRequest {
        let text = |t: &str| pb::ContentPart { part: Some(pb::content_part::Part::Text(t.to_string())) };
        let mut messages = Vec::new();
        if let Some(system) = &self.system {
            messages.push(pb::ChatMessage { role: "system".into(), content: vec![text(system)] });
        }
        let mut content: Vec<pb::ContentPart> = self
            .images
            .iter()
            .map(|data| pb::ContentPart {
                part: Some(pb::content_part::Part::Image(pb::Image {
                    data: data.clone(),
                    mime_type: String::new(),
                })),
            })
            .collect();
        content.push(text(&self.prompt));
        messages.push(pb::ChatMessage { role: "user".into(), content });
        pb::GenerateRequest {
            messages,
            max_new_tokens: self.max_new_tokens,
            stop: self.stop.clone(),
            decoding: Some(pb::DecodingOptions {
                mode: self.mode as i32,
                tree_budget: self.tree_budget,
                temperature: self.sampling.temperature,
                top_k: self.sampling.top_k,
                top_p: self.sampling.top_p,
                min_p: self.sampling.min_p,
                seed: self.sampling.seed,
                stop_token_ids: self.stop_token_ids.clone(),
                logprobs: self.logprobs.is_some(),
                top_logprobs: self.logprobs.unwrap_or(0),
                ..Default::default()
            }),
        }
    }
}

/// Decode milliseconds per generated token after the first (the first comes out of prefill), as
/// the server measured them: the figure a speed-up compares.
pub fn decode_ms_per_token(response: &pb::GenerateResponse) -> f64 {
    let timings = response.timings.unwrap_or_default();
    let tokens = response.usage.unwrap_or_default().generated_tokens.saturating_sub(1).max(1);
    timings.decode_ms / tokens as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_request_puts_the_system_turn_first_and_images_before_the_text() {
        let request = Request {
            system: Some("be brief".into()),
            prompt: "read it".into(),
            images: vec![vec![1, 2, 3]],
            max_new_tokens: 8,
            mode: pb::DecodingMode::SpeculativeTree,
            ..Default::default()
        };
        let wire = request.to_proto();
        assert_eq!(wire.messages.len(), 2);
        assert_eq!(wire.messages[0].role, "system");
        let parts = &wire.messages[1].content;
        assert!(
            matches!(&parts[0].part, Some(pb::content_part::Part::Image(image)) if image.data == [1, 2, 3])
        );
        assert!(matches!(&parts[1].part, Some(pb::content_part::Part::Text(t)) if t == "read it"));
        assert_eq!(wire.decoding.unwrap().mode, pb::DecodingMode::SpeculativeTree as i32);
        assert!(Request::default().with_image_files(&["/nonexistent/image.png"]).is_err());
    }

    #[test]
    fn both_spellings_of_a_mode_parse() {
        use clap::ValueEnum;
        for (name, mode) in
            [("tree", Mode::Tree), ("speculative-tree", Mode::Tree), ("speculative-chain", Mode::Chain)]
        {
            assert_eq!(Mode::from_str(name, false), Ok(mode));
        }
        assert_eq!(pb::DecodingMode::from(Mode::Auto), pb::DecodingMode::Auto);
    }
}
