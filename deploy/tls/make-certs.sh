#!/usr/bin/env bash
# Make a private CA and, signed by it, a server and a client certificate for
# mmcache's TLS and mTLS (with openssl):
#
#   deploy/tls/make-certs.sh DIR [SERVER_NAME ...]
#
# DIR gets ca.crt ca.key server.crt server.key client.crt client.key, a
# tokens file (a random token per role, and one with roles write and read
# for an engine) and engine-token (that one, alone). The server certificate names
# localhost, 127.0.0.1, "mmcache" and every SERVER_NAME given (e.g. the
# Kubernetes Service's DNS name). Keys are created 0600. For trying TLS out
# and for tests; production certificates come from your CA (cert-manager...).
set -euo pipefail

dir=${1:?usage: make-certs.sh DIR [SERVER_NAME ...]}
shift
mkdir -p "$dir"
cd "$dir"
umask 077

san="DNS:localhost,IP:127.0.0.1,DNS:mmcache"
for name in "$@"; do san="$san,DNS:$name"; done

key() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }

key ca.key
openssl req -x509 -new -key ca.key -sha256 -days 365 -subj "/CN=mmcache test CA" \
  -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign" \
  -out ca.crt

sign() { # name subject extensions
  key "$1.key"
  openssl req -new -key "$1.key" -subj "$2" -out "$1.csr"
  printf '%s\n' "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -sha256 \
    -days 365 -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}

# clientAuth too: an engine in the server's own Pod may present the same pair.
sign server "/CN=mmcache" "subjectAltName=$san
extendedKeyUsage=serverAuth,clientAuth"
sign client "/CN=mmcache-client" "extendedKeyUsage=clientAuth"
rm -f ca.srl

engine=$(openssl rand -hex 32)  # an engine's processes write (P0) and read (P1)
{
  echo "# ROLE TOKEN [NAMESPACE,...]: see docs/security.md"
  for role in write read admin; do echo "$role $(openssl rand -hex 32)"; done
  echo "write $engine"
  echo "read $engine"
} > tokens
printf '%s\n' "$engine" > engine-token
chmod 0644 ca.crt server.crt client.crt
echo "made in $dir: ca.crt server.crt/.key client.crt/.key tokens engine-token"
