//! `--lb`: HAProxy (Debian's `haproxy`) in front of both api-servers, as a Kubernetes mesh or
//! ingress puts a proxy before a Deployment's pods: every client connects to it alone, and it
//! spreads the calls over the api-servers by request (HTTP/2 to both sides), and sends a call
//! whose connection to a server failed to the other one. The api-servers then see every caller as
//! the proxy's one address over the proxy's few connections.
//!
//! Readiness as Kubernetes does it: every 500 ms the proxy runs the pods' own readiness probe,
//! `api-server health-check --service rides.v1.RideService` (deploy/k8s), and routes only to a
//! server that answers `SERVING`. An api-server says `NOT_SERVING` from SIGTERM on and keeps
//! answering for [`DRAIN_DELAY_MS`] (the part the pods' preStop sleep plays in Kubernetes) before
//! its GOAWAY, so the proxy has stopped sending it calls by then; a new one gets calls once it is
//! ready, not once its port is open.

use std::{
    os::unix::fs::PermissionsExt,
    path::{Path, PathBuf},
};

use anyhow::Context;

use crate::{
    args::Args,
    setup::{Plan, Wiring},
};

/// `SHUTDOWN_DRAIN_DELAY_MS` of the api-servers behind the proxy: three of its check intervals,
/// so that a check has seen `NOT_SERVING` before the GOAWAY even on a busy machine.
pub(crate) const DRAIN_DELAY_MS: u64 = 1500;

/// What the api-servers behind the proxy add to their environment.
pub(crate) fn api_env() -> [(String, String); 1] {
    [(
        "SHUTDOWN_DRAIN_DELAY_MS".to_owned(),
        DRAIN_DELAY_MS.to_string(),
    )]
}

/// Writes HAProxy's configuration and readiness check into the run's directory; the
/// configuration's path. Absolute paths throughout: HAProxy runs its check with no PATH and not
/// from our working directory.
pub(crate) fn write_config(args: &Args, plan: &Plan, wiring: &Wiring) -> anyhow::Result<PathBuf> {
    let out_dir = std::path::absolute(&plan.out_dir)?;
    let config = out_dir.join("haproxy.cfg");
    let check = out_dir.join("haproxy-readiness.sh");
    let api_server = std::path::absolute(plan.bin_dir.join("api-server"))?;
    std::fs::write(&check, readiness_check(&api_server, &wiring.env))
        .and_then(|()| std::fs::set_permissions(&check, std::fs::Permissions::from_mode(0o700)))
        .with_context(|| format!("writing {}", check.display()))?;
    let pid_file = out_dir.join("haproxy.pid");
    std::fs::write(&config, self::config(args, &pid_file, &check))
        .with_context(|| format!("writing {}", config.display()))?;
    Ok(config)
}

/// HAProxy's external check: the readiness probe of the api-server on the port it is given
/// (HAProxy passes the server's address and port as the third and fourth arguments, and no
/// environment), with the api-servers' own environment.
fn readiness_check(api_server: &Path, env: &[(String, String)]) -> String {
    let quote = |s: &str| format!("'{}'", s.replace('\'', r"'\''"));
    let env: Vec<String> = env
        .iter()
        .filter(|(k, _)| k != "GRPC_LISTEN_ADDR")
        .map(|(k, v)| format!("{k}={}", quote(v)))
        .collect();
    format!(
        "#!/bin/sh\nexec /usr/bin/env -i {} GRPC_LISTEN_ADDR=\"$3:$4\" {} health-check --service rides.v1.RideService\n",
        env.join(" "),
        quote(&api_server.display().to_string())
    )
}

/// HAProxy's configuration for the run, written beside its log. Plaintext on loopback: `--lb`
/// does not go with `--tls-dir`.
fn config(args: &Args, pid_file: &Path, readiness_check: &Path) -> String {
    format!(
        "global
    maxconn 4096
    pidfile {pid_file}
    # The readiness check is a process of its own, as the kubelet's exec probe is.
    external-check
    insecure-fork-wanted
    log stdout format raw local0

defaults
    mode http
    # One line per call that was not plain: retried, redispatched, cut or timed out (the
    # evidence for a key a client found in use after a rollout).
    log global
    option httplog
    option dontlog-normal
    timeout connect 1s
    timeout client 120s
    timeout server 60s
    timeout check 2s
    # A call whose connection to a server failed, or that got no answer at all because the
    # server went away, is sent again to the other server: CreateRide carries its idempotency key,
    # so sending it twice is what a client's own retry does.
    retries 3
    retry-on conn-failure empty-response
    option redispatch 1

frontend api
    bind 127.0.0.1:{lb} proto h2
    default_backend api_servers

backend api_servers
    balance roundrobin
    option external-check
    external-check command {check}
    server api-a 127.0.0.1:{a} proto h2 check inter 500ms fall 1 rise 1
    server api-b 127.0.0.1:{b} proto h2 check inter 500ms fall 1 rise 1
",
        pid_file = pid_file.display(),
        check = readiness_check.display(),
        lb = args.lb_port,
        a = args.grpc_port,
        b = args.grpc_port_b,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_readiness_check_runs_the_probe_on_the_port_haproxy_gives_with_the_servers_environment() {
        let env = [
            ("DATABASE_URL".to_owned(), "postgres://x/it's".to_owned()),
            ("GRPC_LISTEN_ADDR".to_owned(), "127.0.0.1:1".to_owned()),
        ];
        let script = readiness_check(Path::new("/bin dir/api-server"), &env);
        assert_eq!(
            script,
            "#!/bin/sh\nexec /usr/bin/env -i DATABASE_URL='postgres://x/it'\\''s' \
             GRPC_LISTEN_ADDR=\"$3:$4\" '/bin dir/api-server' health-check --service \
             rides.v1.RideService\n"
        );
    }
}
