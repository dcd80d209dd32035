#!/usr/bin/env bash
# SMTP over TLS against a real mail server: Debian's Postfix, run as a private instance on
# loopback (its own configuration, queue, mailbox and log under .run/smtp-relay; the system's
# Postfix, if any, is not touched), with a certificate from a throwaway CA:
#
#   127.0.0.1:25587  STARTTLS required (smtpd_tls_security_level=encrypt): smtp://…?tls=required
#   127.0.0.1:25465  TLS from the first byte (smtpd_tls_wrappermode):      smtps://…
#
# Then workers/tests/fleet/smtp_relay.rs (the receipt worker's mailer, ignored by default and run
# here by nextest over the workspace, so the test command's build serves it unchanged) sends
# a receipt over each with the relay's certificate checked against the CA (cacertfile=), sees a CA
# that did not sign it refused on both, and plaintext refused on the STARTTLS port; and this
# script checks that both receipts, and nothing else, are in the relay's mailbox and that the
# relay logged TLS connections.
# Installs `postfix` (Debian, "No configuration": no system mail service is set up) and `openssl`
# when absent. Stops the relay and removes its files at the end (RELAY_KEEP=1 keeps them).
#
# Usage: deploy/local/smtp-relay-tls.sh (deploy/local/test.sh runs it after the test suite; SMTP_RELAY=0
# skips it there)
set -euo pipefail
# shellcheck source=deploy/local/lib.sh
source "$(dirname "${BASH_SOURCE[0]}")/lib.sh"
cd "$REPO_ROOT"

STARTTLS_PORT=25587 SMTPS_PORT=25465
DIR="$REPO_ROOT/.run/smtp-relay"
ETC="$DIR/etc"
RCPT=rider@rides.example.test

ensure_cargo
ensure_nextest
if ! [ -x /usr/sbin/postfix ]; then
  as_root sh -c 'echo "postfix postfix/main_mailer_type select No configuration" | debconf-set-selections'
  apt_install postfix
fi
require_free_ports "$STARTTLS_PORT the relay's STARTTLS port" "$SMTPS_PORT the relay's smtps port"

rm -rf "$DIR"
mkdir -p "$ETC" "$DIR/queue" "$DIR/data" "$DIR/mail"
make_tls_certificates "$DIR/tls" 127.0.0.1        # the relay's CA, server.pem valid for 127.0.0.1
make_tls_certificates "$DIR/other-tls" 127.0.0.1  # another CA, which must not be trusted for it
as_root chown postfix "$DIR/data"
# The virtual delivery agent writes the mailbox as `nobody`.
as_root chown nobody "$DIR/mail"

cat >"$ETC/main.cf" <<EOF2
compatibility_level = 3.6
queue_directory = $DIR/queue
data_directory = $DIR/data
command_directory = /usr/sbin
daemon_directory = /usr/lib/postfix/sbin
shlib_directory = /usr/lib/postfix
meta_directory = /etc/postfix
mail_owner = postfix
setgid_group = postdrop
maillog_file = $DIR/maillog
maillog_file_prefixes = $DIR
myhostname = relay.rides.example.test
mydomain = rides.example.test
myorigin = \$myhostname
mydestination =
inet_interfaces = 127.0.0.1
inet_protocols = ipv4
mynetworks = 127.0.0.0/8
alias_maps =
alias_database =
biff = no
smtpd_banner = \$myhostname ESMTP
smtpd_relay_restrictions = permit_mynetworks, reject_unauth_destination
# Every recipient of the domain lands in one Maildir, owned by nobody.
virtual_mailbox_domains = rides.example.test
virtual_mailbox_base = $DIR/mail
virtual_mailbox_maps = static:inbox/
virtual_uid_maps = static:65534
virtual_gid_maps = static:65534
virtual_minimum_uid = 100
# TLS: required on every port (STARTTLS before MAIL FROM, or TLS from the first byte).
smtpd_tls_cert_file = $DIR/tls/server.pem
smtpd_tls_key_file = $DIR/tls/server.key
smtpd_tls_security_level = encrypt
smtpd_tls_mandatory_protocols = >=TLSv1.2
smtpd_tls_loglevel = 1
EOF2
# No chroot (the last columns: private, unpriv, chroot, wakeup, maxproc, command).
cat >"$ETC/master.cf" <<EOF2
127.0.0.1:$STARTTLS_PORT inet n - n - - smtpd
127.0.0.1:$SMTPS_PORT inet n - n - - smtpd -o smtpd_tls_wrappermode=yes
pickup    unix n - n 60 1 pickup
cleanup   unix n - n -  0 cleanup
qmgr      unix n - n 300 1 qmgr
tlsmgr    unix - - n 1000? 1 tlsmgr
rewrite   unix - - n -  - trivial-rewrite
bounce    unix - - n -  0 bounce
defer     unix - - n -  0 bounce
trace     unix - - n -  0 bounce
verify    unix - - n -  1 verify
flush     unix n - n 1000? 0 flush
proxymap  unix - - n -  - proxymap
smtp      unix - - n -  - smtp
relay     unix - - n -  - smtp
showq     unix n - n -  - showq
error     unix - - n -  - error
retry     unix - - n -  - error
discard   unix - - n -  - discard
local     unix - n n -  - local
virtual   unix - n n -  - virtual
anvil     unix - - n -  1 anvil
scache    unix - - n -  1 scache
postlog   unix-dgram n - n - 1 postlogd
EOF2

stop_relay() {
  local status=$?
  as_root /usr/sbin/postfix -c "$ETC" stop >/dev/null 2>&1 || true
  if [ "$status" -ne 0 ] || [ "${RELAY_KEEP:-0}" = 1 ]; then
    echo "the relay's files are kept in ${DIR#"$REPO_ROOT"/} (log: maillog)" >&2
  else
    as_root rm -rf "$DIR"
  fi
  exit "$status"
}
trap stop_relay INT TERM EXIT

log "Postfix on 127.0.0.1:$STARTTLS_PORT (STARTTLS required) and :$SMTPS_PORT (implicit TLS)"
as_root /usr/sbin/postfix -c "$ETC" check
as_root /usr/sbin/postfix -c "$ETC" start
wait_for_port 127.0.0.1 "$STARTTLS_PORT" "Postfix (STARTTLS)" 30
wait_for_port 127.0.0.1 "$SMTPS_PORT" "Postfix (smtps)" 30

log "the receipt mailer against it (workers/tests/fleet/smtp_relay.rs)"
export SMTP_RELAY_RCPT=$RCPT
export SMTP_RELAY_STARTTLS_URL="smtp://127.0.0.1:$STARTTLS_PORT?tls=required&cacertfile=$DIR/tls/ca.pem"
export SMTP_RELAY_SMTPS_URL="smtps://127.0.0.1:$SMTPS_PORT?cacertfile=$DIR/tls/ca.pem"
export SMTP_RELAY_PLAIN_URL="smtp://127.0.0.1:$STARTTLS_PORT"
export SMTP_RELAY_OTHER_CA="$DIR/other-tls/ca.pem"
# --workspace, as the test command builds it: `-p workers` alone would resolve other features for
# the shared dependencies and rebuild them.
cargo nextest run --workspace --locked --profile "${NEXTEST_PROFILE:-default}" --run-ignored only \
  --test-threads 1 -E 'package(workers) & binary(fleet) & test(/^smtp_relay::/)'

log "both receipts delivered, each over a TLS connection the relay logged"
deadline=$((SECONDS + 30))
for ride in 1 2; do
  until grep -rqs "^Message-ID: <ride-$ride.receipt@rocketrides.test>" "$DIR/mail/inbox/new" "$DIR/mail/inbox/cur"; do
    [ $SECONDS -lt $deadline ] || die "receipt $ride is not in the relay's mailbox (log: $DIR/maillog)"
    sleep 0.5
  done
done
# The refused attempts delivered nothing: exactly the two receipts.
count=$(find "$DIR/mail/inbox/new" "$DIR/mail/inbox/cur" -type f | wc -l)
[ "$count" = 2 ] || die "$count messages in the relay's mailbox, not 2 (log: $DIR/maillog)"
tls_logins=$(grep -c "TLS connection established from localhost\[127.0.0.1\]" "$DIR/maillog" || true)
[ "$tls_logins" -ge 2 ] || die "the relay logged $tls_logins TLS connections, not 2 or more (log: $DIR/maillog)"
grep -E "TLS connection established from" "$DIR/maillog" | sed -E 's/^.*(TLS connection established.*)$/  \1/' | sort | uniq -c >&2
echo "deploy/local/smtp-relay-tls.sh: receipts reached Postfix over STARTTLS and implicit TLS, certificate checked; another CA and plaintext refused" >&2
