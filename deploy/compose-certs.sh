#!/usr/bin/env bash
# The one-shot `certs` service of deploy/compose.yaml runs this (in the rabbitmq image, which
# carries the openssl CLI) before anything else starts: it writes a throwaway CA and the
# certificates of every TLS hop into DIR (the named volume `tls`), which the other services mount
# read-only at /etc/rides/tls. EC P-256 keys, valid CERT_DAYS (90) days. The CA's private key is
# never written to DIR: nothing can issue more certificates from it, and the next run that finds
# a certificate missing or within 7 days of its end replaces all of them (then restart the stack,
# `docker compose -f deploy/compose.yaml restart`: only the api-server re-reads its files).
#
#   ca.pem                       the CA every client trusts (API_SERVER_CA, GRPC_TLS_CLIENT_CA,
#                                sslrootcert=, cacertfile=)
#   api-server.pem/.key          gRPC server (DNS api-server, localhost, IP 127.0.0.1), also the
#                                client certificate of its own health check: serverAuth, clientAuth
#   completer.pem/.key           the completer's client certificate (clientAuth)
#   client.pem/.key              a client certificate for people (grpcurl from the host)
#   postgres.pem/.key            PostgreSQL (DNS postgres, localhost)
#   rabbitmq.pem/.key            RabbitMQ's AMQPS listener (DNS rabbitmq, localhost)
#   mailpit.pem/.key             Mailpit's STARTTLS (DNS mailpit, localhost)
#
# Keys are mode 0640, owned by root and by the group of the process that reads them: 10001 (the
# Rust images' user), 999 (the postgres and rabbitmq images' users; PostgreSQL accepts a root-owned
# key that its group may read), 0 (Mailpit runs as root or as an arbitrary user of group 0).
#
# Usage: compose-certs.sh DIR      (as root: it sets the keys' groups)
set -euo pipefail

dir=${1:?usage: compose-certs.sh DIR}
days=${CERT_DAYS:-90}
# name  group  extended key usage     subject alternative names
leaves=(
  "api-server 10001 serverAuth,clientAuth DNS:api-server,DNS:localhost,IP:127.0.0.1"
  "completer  10001 clientAuth            -"
  "client     10001 clientAuth            -"
  "postgres   999   serverAuth            DNS:postgres,DNS:localhost,IP:127.0.0.1"
  "rabbitmq   999   serverAuth            DNS:rabbitmq,DNS:localhost,IP:127.0.0.1"
  "mailpit    0     serverAuth            DNS:mailpit,DNS:localhost,IP:127.0.0.1"
)

fresh() { # every file present, and no certificate ending within 7 days
  local leaf name
  [ -s "$dir/ca.pem" ] && openssl x509 -checkend 604800 -noout -in "$dir/ca.pem" >/dev/null || return 1
  for leaf in "${leaves[@]}"; do
    read -r name _ <<<"$leaf"
    [ -s "$dir/$name.key" ] && [ -s "$dir/$name.pem" ] || return 1
    openssl x509 -checkend 604800 -noout -in "$dir/$name.pem" >/dev/null || return 1
  done
}

if fresh; then
  echo "compose-certs: the certificates in $dir are valid for more than 7 days; kept"
  exit 0
fi

umask 077
work=$(mktemp -d "$dir/.new.XXXXXX")
trap 'rm -rf "$work"' EXIT
cat >"$work/openssl.cnf" <<'CNF'
[req]
distinguished_name = dn
prompt = no
[dn]
CN = Rocket Rides compose CA (throwaway)
[ca]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
CNF
export OPENSSL_CONF="$work/openssl.cnf" # not the image's configuration
openssl req -x509 -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -days "$days" \
  -config "$work/openssl.cnf" -extensions ca -keyout "$work/ca.key" -out "$work/ca.pem" 2>/dev/null

for leaf in "${leaves[@]}"; do
  read -r name group usage sans <<<"$leaf"
  openssl req -new -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes -subj "/CN=$name" \
    -keyout "$work/$name.key" -out "$work/$name.csr" 2>/dev/null
  {
    echo "basicConstraints = critical, CA:FALSE"
    echo "keyUsage = critical, digitalSignature"
    echo "extendedKeyUsage = $usage"
    echo "authorityKeyIdentifier = keyid"
    [ "$sans" = - ] || echo "subjectAltName = $sans"
  } >"$work/$name.ext"
  openssl x509 -req -in "$work/$name.csr" -CA "$work/ca.pem" -CAkey "$work/ca.key" \
    -set_serial "0x$(openssl rand -hex 16)" -days "$days" -extfile "$work/$name.ext" \
    -out "$work/$name.pem" 2>/dev/null
  chown "0:$group" "$work/$name.key"
  chmod 0640 "$work/$name.key"
  chmod 0644 "$work/$name.pem"
done
chmod 0644 "$work/ca.pem"

# Into place (renames within the volume), the CA last.
for leaf in "${leaves[@]}"; do
  read -r name _ <<<"$leaf"
  mv -f "$work/$name.key" "$work/$name.pem" "$dir/"
done
mv -f "$work/ca.pem" "$dir/ca.pem"
echo "compose-certs: a new CA and ${#leaves[@]} certificates (valid $days days) in $dir"
