//! `--lb`: HAProxy (Debian's `haproxy`) in front of both api-servers, as a Kubernetes mesh or
//! ingress puts a proxy before a Deployment's pods: every client connects to it alone, and it
//! spreads the calls over the api-servers by request (HTTP/2 to both sides), checks each server's
//! port every 500 ms, and sends a call whose connection to a server failed to the other one. The
//! api-servers then see every caller as the proxy's one address over the proxy's few connections.

use std::path::Path;

use crate::args::Args;

/// HAProxy's configuration for the run, written beside its log. Plaintext on loopback: `--lb`
/// does not go with `--tls-dir`.
pub(crate) fn config(args: &Args, pid_file: &Path) -> String {
    format!(
        "global
    maxconn 4096
    pidfile {pid_file}

defaults
    mode http
    timeout connect 1s
    timeout client 120s
    timeout server 60s
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
    server api-a 127.0.0.1:{a} proto h2 check inter 500ms fall 1 rise 1
    server api-b 127.0.0.1:{b} proto h2 check inter 500ms fall 1 rise 1
",
        pid_file = pid_file.display(),
        lb = args.lb_port,
        a = args.grpc_port,
        b = args.grpc_port_b,
    )
}
