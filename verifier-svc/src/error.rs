//! The verifier's error type and its one mapping to gRPC status codes.

use glance_input::InputError;
use glance_models::ModelError;
use tonic::Status;

#[derive(Debug, thiserror::Error)]
pub enum VerifierError {
    /// The request itself is wrong; the message names the field.
    #[error("{field}: {reason}")]
    InvalidArgument { field: String, reason: String },
    /// Images, chat template or tokenization refused the input.
    #[error(transparent)]
    Input(#[from] InputError),
    /// The request needs something this server is not set up for (e.g. a drafter).
    #[error("{0}")]
    NoDrafter(String),
    /// Too many requests are queued or running.
    #[error("server busy: {0}")]
    Busy(String),
    /// The client went away.
    #[error("request cancelled")]
    Cancelled,
    /// The client's deadline (grpc-timeout) passed before the generation finished.
    #[error("deadline exceeded before the generation finished")]
    DeadlineExceeded,
    /// The engine stopped (shutdown or a crashed worker).
    #[error("generation engine unavailable: {0}")]
    Unavailable(String),
    /// A model failure that is not the client's fault.
    #[error("model error: {0}")]
    Model(ModelError),
}

impl VerifierError {
    pub fn invalid(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self::InvalidArgument { field: field.into(), reason: reason.into() }
    }
}

impl From<ModelError> for VerifierError {
    fn from(e: ModelError) -> Self {
        match e {
            // Inputs reach the model only after validation, so a shape complaint is a bad prompt
            // (e.g. placeholder count) rather than an internal failure.
            ModelError::Input(reason) => Self::invalid("messages", reason),
            other => Self::Model(other),
        }
    }
}

impl From<VerifierError> for Status {
    fn from(e: VerifierError) -> Self {
        let message = e.to_string();
        match e {
            VerifierError::InvalidArgument { .. } | VerifierError::Input(_) => {
                Status::invalid_argument(message)
            }
            VerifierError::NoDrafter(_) => Status::failed_precondition(message),
            VerifierError::Busy(_) => Status::resource_exhausted(message),
            VerifierError::Cancelled => Status::cancelled(message),
            VerifierError::DeadlineExceeded => Status::deadline_exceeded(message),
            VerifierError::Unavailable(_) => Status::unavailable(message),
            VerifierError::Model(_) => Status::internal(message),
        }
    }
}
