//! A throwaway PKI for the TLS tests: a CA and the certificates it issues (servers for
//! `localhost` / 127.0.0.1, clients), written as PEM files into a directory of their own.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair,
    KeyUsagePurpose,
};

pub struct TestPki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
}

/// A certificate and its key, as files.
pub struct Issued {
    pub cert: PathBuf,
    pub key: PathBuf,
}

impl Issued {
    /// The flags that make a service serve TLS with it (the same on both services).
    pub fn serving_args(&self) -> Vec<&str> {
        fn path(p: &Path) -> &str {
            p.to_str().expect("utf-8 path")
        }
        vec!["--tls-cert", path(&self.cert), "--tls-key", path(&self.key)]
    }
}

impl TestPki {
    /// A fresh CA named `name`, its files under the system's temporary directory.
    pub fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("glance-pki-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("pki dir");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA params");
        params.distinguished_name.push(DnType::CommonName, format!("glance test CA {name}"));
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
        let ca = CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key")).expect("CA");
        std::fs::write(dir.join("ca.pem"), ca.pem()).expect("ca.pem");
        Self { dir, ca }
    }

    /// The CA certificate (PEM).
    pub fn ca(&self) -> PathBuf {
        self.dir.join("ca.pem")
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A certificate for `names` (DNS names or IP addresses), usable by a server and a client.
    pub fn issue(&self, file: &str, names: &[&str]) -> Issued {
        let names: Vec<String> = names.iter().map(|n| n.to_string()).collect();
        let mut params = CertificateParams::new(names).expect("leaf params");
        params.distinguished_name.push(DnType::CommonName, file);
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature, KeyUsagePurpose::KeyEncipherment];
        params.extended_key_usages =
            vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth];
        let key = KeyPair::generate().expect("leaf key");
        let cert = params.signed_by(&key, &self.ca).expect("leaf certificate");
        let issued =
            Issued { cert: self.dir.join(format!("{file}.pem")), key: self.dir.join(format!("{file}.key")) };
        std::fs::write(&issued.cert, cert.pem()).expect("cert");
        std::fs::write(&issued.key, key.serialize_pem()).expect("key");
        issued
    }
}

impl Drop for TestPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
