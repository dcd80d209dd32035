//! Throwaway certificate authorities and the PEM files a TLS test hands to a server or a client.

use tonic::transport::ClientTlsConfig;

/// A throwaway certificate authority for TLS tests.
pub struct TestCa {
    issuer: rcgen::Issuer<'static, rcgen::KeyPair>,
    /// The CA's own certificate, PEM: what a peer trusts.
    pub cert_pem: String,
}

impl TestCa {
    pub fn new(name: &str) -> TestCa {
        let mut params = rcgen::CertificateParams::new(Vec::<String>::new()).unwrap();
        params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.key_usages = vec![
            rcgen::KeyUsagePurpose::KeyCertSign,
            rcgen::KeyUsagePurpose::DigitalSignature,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert_pem = params.self_signed(&key).unwrap().pem();
        TestCa {
            issuer: rcgen::Issuer::new(params, key),
            cert_pem,
        }
    }

    /// A certificate for `localhost` and 127.0.0.1, good for a server or a client: (certificate
    /// PEM, private key PEM).
    pub fn issue(&self, name: &str) -> (String, String) {
        let mut params =
            rcgen::CertificateParams::new(vec!["localhost".to_owned(), "127.0.0.1".to_owned()])
                .unwrap();
        params
            .distinguished_name
            .push(rcgen::DnType::CommonName, name);
        params.extended_key_usages = vec![
            rcgen::ExtendedKeyUsagePurpose::ServerAuth,
            rcgen::ExtendedKeyUsagePurpose::ClientAuth,
        ];
        let key = rcgen::KeyPair::generate().unwrap();
        let cert = params.signed_by(&key, &self.issuer).unwrap();
        (cert.pem(), key.serialize_pem())
    }

    /// A client identity signed by this CA, for `ClientTlsConfig::identity`.
    pub fn client_identity(&self, name: &str) -> tonic::transport::Identity {
        let (cert, key) = self.issue(name);
        tonic::transport::Identity::from_pem(cert, key)
    }

    /// What a client that trusts this CA uses.
    pub fn client_tls(&self) -> ClientTlsConfig {
        ClientTlsConfig::new()
            .ca_certificate(tonic::transport::Certificate::from_pem(&self.cert_pem))
    }
}

/// A server's PEM files in a directory of their own, removed on drop.
pub struct TlsFiles {
    pub dir: std::path::PathBuf,
    pub cert: std::path::PathBuf,
    pub key: std::path::PathBuf,
    /// Written only for mutual TLS.
    pub client_ca: Option<std::path::PathBuf>,
}

impl TlsFiles {
    /// A server certificate from `ca`; with `client_ca`, clients must present one it signed.
    pub fn new(ca: &TestCa, client_ca: Option<&TestCa>) -> TlsFiles {
        let dir = std::env::temp_dir().join(format!("rides-tls-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let files = TlsFiles {
            cert: dir.join("server.pem"),
            key: dir.join("server.key"),
            client_ca: client_ca.map(|_| dir.join("client-ca.pem")),
            dir,
        };
        files.replace_server_certificate(ca);
        if let (Some(path), Some(client_ca)) = (&files.client_ca, client_ca) {
            std::fs::write(path, &client_ca.cert_pem).unwrap();
        }
        files
    }

    /// Writes a new server certificate from `ca`, each file replaced whole (as a deployment
    /// tool's rename would), so a reader never sees half a file.
    pub fn replace_server_certificate(&self, ca: &TestCa) {
        let (cert, key) = ca.issue("api-server");
        for (path, pem) in [(&self.key, key), (&self.cert, cert)] {
            let staged = path.with_extension("new");
            std::fs::write(&staged, pem).unwrap();
            std::fs::rename(&staged, path).unwrap();
        }
    }

    /// The server's configuration overrides, for [`TestApp::spawn_with`]. The files are polled
    /// every second.
    pub fn env(&self) -> Vec<(&'static str, String)> {
        let mut env = vec![
            ("GRPC_TLS_CERT", self.cert.display().to_string()),
            ("GRPC_TLS_KEY", self.key.display().to_string()),
            ("GRPC_TLS_RELOAD_SECS", "1".to_owned()),
        ];
        if let Some(client_ca) = &self.client_ca {
            env.push(("GRPC_TLS_CLIENT_CA", client_ca.display().to_string()));
        }
        env
    }
}

impl Drop for TlsFiles {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}
