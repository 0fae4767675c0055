//! Transport security shared by both services and the client: TLS server and client
//! configurations read from PEM files (mTLS when a client CA is given), and the API-key check of
//! the public API as a tonic interceptor. Everything here fails at start-up with the flag and the
//! file named, never at the first request.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;
use tonic::transport::{Certificate, ClientTlsConfig, Identity, ServerTlsConfig};
use tonic::{Request, Status};

/// Why a security setting cannot be used; printed at start-up.
#[derive(Debug, thiserror::Error)]
pub enum SecurityError {
    #[error("{flag} {}: {reason}", path.display())]
    Read { flag: &'static str, path: PathBuf, reason: String },
    #[error("{flag} {}: {reason}", path.display())]
    Invalid { flag: &'static str, path: PathBuf, reason: String },
    #[error("{0}")]
    Flags(String),
}

fn read(flag: &'static str, path: &Path) -> Result<Vec<u8>, SecurityError> {
    std::fs::read(path).map_err(|e| SecurityError::Read { flag, path: path.into(), reason: e.to_string() })
}

/// A PEM file that must hold at least one `label` block (CERTIFICATE, or a PRIVATE KEY of any kind).
fn read_pem(flag: &'static str, path: &Path, label: &str) -> Result<Vec<u8>, SecurityError> {
    let pem = read(flag, path)?;
    let text = String::from_utf8_lossy(&pem);
    let found = text
        .lines()
        .any(|l| l.starts_with("-----BEGIN ") && l.trim_end().ends_with(&format!("{label}-----")));
    if !found {
        let reason = format!("no PEM block ending in {label:?}");
        return Err(SecurityError::Invalid { flag, path: path.into(), reason });
    }
    Ok(pem)
}

/// A server's TLS files: its certificate chain and key, and the CA that client certificates must
/// chain to (mTLS; without it any client may connect).
#[derive(Clone, Debug, Default)]
pub struct ServerTlsFiles {
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub client_ca: Option<PathBuf>,
}

impl ServerTlsFiles {
    /// The server's TLS configuration; `None` (plaintext) when no certificate is given. The flag
    /// names (`--tls-cert` …) are the same on both services.
    pub fn config(&self) -> Result<Option<ServerTlsConfig>, SecurityError> {
        let (cert, key) = match (&self.cert, &self.key) {
            (None, None) if self.client_ca.is_none() => return Ok(None),
            (Some(cert), Some(key)) => (cert, key),
            _ => {
                return Err(SecurityError::Flags(
                    "--tls-cert and --tls-key go together (and --tls-client-ca needs both)".into(),
                ))
            }
        };
        let identity = Identity::from_pem(
            read_pem("--tls-cert", cert, "CERTIFICATE")?,
            read_pem("--tls-key", key, "PRIVATE KEY")?,
        );
        let mut config = ServerTlsConfig::new().identity(identity);
        if let Some(ca) = &self.client_ca {
            config =
                config.client_ca_root(Certificate::from_pem(read_pem("--tls-client-ca", ca, "CERTIFICATE")?));
        }
        Ok(Some(config))
    }
}

/// A client's TLS files: the CA the server's certificate must chain to, the client's own
/// certificate and key (mTLS), and the name the server's certificate must carry.
#[derive(Clone, Debug, Default)]
pub struct ClientTlsFiles {
    pub ca: Option<PathBuf>,
    pub cert: Option<PathBuf>,
    pub key: Option<PathBuf>,
    pub domain: Option<String>,
}

/// The flag names a client's TLS files come from (they differ between the verifier's drafter
/// hop and the `glance` client).
#[derive(Clone, Copy, Debug)]
pub struct ClientTlsFlags {
    pub ca: &'static str,
    pub cert: &'static str,
    pub key: &'static str,
}

impl ClientTlsFiles {
    /// The client's TLS configuration for an `https` URL whose host is `host` (the name the
    /// server's certificate is checked against unless `domain` overrides it); `None` for `http`.
    pub fn config(
        &self,
        flags: ClientTlsFlags,
        https: bool,
        host: &str,
    ) -> Result<Option<ClientTlsConfig>, SecurityError> {
        let any = self.ca.is_some() || self.cert.is_some() || self.key.is_some();
        if !https {
            if any {
                return Err(SecurityError::Flags(format!(
                    "{} / {} / {} are set but the URL is http: use https",
                    flags.ca, flags.cert, flags.key
                )));
            }
            return Ok(None);
        }
        let ca = self.ca.as_ref().ok_or_else(|| {
            SecurityError::Flags(format!("an https URL needs {}: the CA its certificate chains to", flags.ca))
        })?;
        let domain = self.domain.clone().unwrap_or_else(|| host.trim_matches(['[', ']']).to_string());
        let mut config = ClientTlsConfig::new()
            .ca_certificate(Certificate::from_pem(read_pem(flags.ca, ca, "CERTIFICATE")?))
            .domain_name(domain);
        match (&self.cert, &self.key) {
            (None, None) => {}
            (Some(cert), Some(key)) => {
                config = config.identity(Identity::from_pem(
                    read_pem(flags.cert, cert, "CERTIFICATE")?,
                    read_pem(flags.key, key, "PRIVATE KEY")?,
                ))
            }
            _ => return Err(SecurityError::Flags(format!("{} and {} go together", flags.cert, flags.key))),
        }
        Ok(Some(config))
    }
}

/// The API keys the public API accepts (one per line of the key file; blank lines and `#`
/// comments ignored: several keys let a key be rotated without downtime). Kept as SHA-256 digests
/// and compared in constant time, so neither a key's bytes nor its length leak through timing.
#[derive(Clone)]
pub struct ApiKeys {
    digests: Arc<Vec<[u8; 32]>>,
}

impl std::fmt::Debug for ApiKeys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "ApiKeys({} keys)", self.digests.len())
    }
}

fn digest(key: &[u8]) -> [u8; 32] {
    Sha256::digest(key).into()
}

impl ApiKeys {
    pub fn from_file(path: &Path) -> Result<Self, SecurityError> {
        let text = read("--api-key-file", path)?;
        let text = String::from_utf8(text).map_err(|_| SecurityError::Invalid {
            flag: "--api-key-file",
            path: path.into(),
            reason: "not UTF-8".into(),
        })?;
        Self::parse(&text).map_err(|reason| SecurityError::Invalid {
            flag: "--api-key-file",
            path: path.into(),
            reason,
        })
    }

    fn parse(text: &str) -> Result<Self, String> {
        let keys: Vec<&str> =
            text.lines().map(str::trim).filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
        if keys.is_empty() {
            return Err("no API key in the file".into());
        }
        if let Some(short) = keys.iter().find(|k| k.len() < 16) {
            return Err(format!("a key of {} characters: use at least 16", short.len()));
        }
        if let Some(bad) = keys.iter().find(|k| !k.bytes().all(|b| b.is_ascii_graphic())) {
            return Err(format!("a key of {} characters holds a space or a non-ASCII character", bad.len()));
        }
        Ok(Self { digests: Arc::new(keys.iter().map(|k| digest(k.as_bytes())).collect()) })
    }

    /// Whether `presented` is one of the keys (every key is compared, in constant time).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        let presented = digest(presented);
        self.digests.iter().fold(subtle::Choice::from(0), |found, key| found | key.ct_eq(&presented)).into()
    }

    /// The request's key from `authorization: Bearer KEY`, checked: UNAUTHENTICATED without one
    /// or with a wrong one (the message says which, never the key).
    pub fn check<T>(&self, request: Request<T>) -> Result<Request<T>, Status> {
        let header = request.metadata().get("authorization").ok_or_else(|| {
            Status::unauthenticated("this server needs an API key: send `authorization: Bearer <key>`")
        })?;
        let key = header
            .as_bytes()
            .strip_prefix(b"Bearer ")
            .ok_or_else(|| Status::unauthenticated("the authorization header must be `Bearer <key>`"))?;
        if self.accepts(key) {
            Ok(request)
        } else {
            Err(Status::unauthenticated("the API key is not valid"))
        }
    }
}

/// The API-key check as a tonic interceptor: wraps the services that need a key (the public API
/// and its reflection), never health (probes send no headers). `None` lets everything through.
#[derive(Clone, Debug)]
pub struct RequireApiKey(pub Option<ApiKeys>);

impl tonic::service::Interceptor for RequireApiKey {
    fn call(&mut self, request: Request<()>) -> Result<Request<()>, Status> {
        match &self.0 {
            Some(keys) => keys.check(request),
            None => Ok(request),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_header(value: &str) -> Request<()> {
        let mut request = Request::new(());
        request.metadata_mut().insert("authorization", value.parse().unwrap());
        request
    }

    #[test]
    fn keys_are_checked_and_the_refusals_say_why() {
        let keys =
            ApiKeys::parse("# rotated weekly\nfirst-key-0123456789\n\n  second-key-abcdefghij  \n").unwrap();
        assert!(keys.accepts(b"first-key-0123456789") && keys.accepts(b"second-key-abcdefghij"));
        assert!(
            !keys.accepts(b"first-key-012345678") && !keys.accepts(b"") && !keys.accepts(b"# rotated weekly")
        );
        assert!(keys.check(with_header("Bearer second-key-abcdefghij")).is_ok());
        let refusals = [
            keys.check(Request::new(())).unwrap_err(),
            keys.check(with_header("Basic second-key-abcdefghij")).unwrap_err(),
            keys.check(with_header("Bearer second-key-abcdefghiJ")).unwrap_err(),
        ];
        assert!(refusals.iter().all(|s| s.code() == tonic::Code::Unauthenticated));
        assert!(refusals[0].message().contains("needs an API key"));
        assert!(refusals[1].message().contains("Bearer"));
        assert!(!refusals[2].message().contains("abcdefghi"), "a refusal never echoes a key");
        let mut open = RequireApiKey(None);
        assert!(tonic::service::Interceptor::call(&mut open, Request::new(())).is_ok());
    }

    #[test]
    fn key_files_without_usable_keys_are_refused() {
        assert!(ApiKeys::parse("# nothing\n\n").unwrap_err().contains("no API key"));
        assert!(ApiKeys::parse("short\n").unwrap_err().contains("at least 16"));
        assert!(ApiKeys::parse("a key with spaces in it\n").unwrap_err().contains("space"));
    }

    #[test]
    fn tls_flags_must_come_in_working_sets() {
        let dir = std::env::temp_dir().join(format!("glance-security-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let cert = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert_path, key_path) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert_path, cert.cert.pem()).unwrap();
        std::fs::write(&key_path, cert.signing_key.serialize_pem()).unwrap();
        let server = |cert: Option<&Path>, key: Option<&Path>, ca: Option<&Path>| ServerTlsFiles {
            cert: cert.map(Into::into),
            key: key.map(Into::into),
            client_ca: ca.map(Into::into),
        };
        assert!(server(None, None, None).config().unwrap().is_none());
        assert!(server(Some(&cert_path), Some(&key_path), Some(&cert_path)).config().unwrap().is_some());
        assert!(matches!(server(Some(&cert_path), None, None).config(), Err(SecurityError::Flags(_))));
        assert!(matches!(server(None, None, Some(&cert_path)).config(), Err(SecurityError::Flags(_))));
        // A key where the certificate belongs, a missing file: the flag and the file are named.
        let swapped = server(Some(&key_path), Some(&key_path), None).config().unwrap_err().to_string();
        assert!(swapped.contains("--tls-cert") && swapped.contains("CERTIFICATE"), "{swapped}");
        let missing = server(Some(&dir.join("nope.pem")), Some(&key_path), None).config().unwrap_err();
        assert!(missing.to_string().contains("nope.pem"), "{missing}");

        let flags = ClientTlsFlags { ca: "--ca", cert: "--cert", key: "--key" };
        let client = ClientTlsFiles { ca: Some(cert_path.clone()), ..Default::default() };
        assert!(client.config(flags, true, "localhost").unwrap().is_some());
        assert!(client.config(flags, false, "localhost").unwrap_err().to_string().contains("https"));
        assert!(ClientTlsFiles::default().config(flags, false, "h").unwrap().is_none());
        assert!(ClientTlsFiles::default().config(flags, true, "h").unwrap_err().to_string().contains("--ca"));
        let half = ClientTlsFiles { cert: Some(cert_path), ..client };
        assert!(half.config(flags, true, "localhost").unwrap_err().to_string().contains("go together"));
        std::fs::remove_dir_all(&dir).ok();
    }
}
