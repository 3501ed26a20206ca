#!/bin/sh
# Certificates for trainwatch daemons served beyond loopback with mutual TLS:
#   make-certs.sh DIR NAME...
# makes in DIR (kept if already there) a CA (ca.crt, ca.key: keep ca.key off the nodes), a
# server certificate per NAME (NAME.crt, NAME.key: a node's DNS name or IP address, as
# Prometheus dials it, or one shared name that Prometheus sets as server_name), and the
# client certificate Prometheus presents (prometheus.crt, prometheus.key; its SAN is
# "prometheus", the name web.yml's client_allowed_sans admits). Needs openssl.
set -eu
[ $# -ge 2 ] || { echo "usage: $0 DIR NAME..." >&2; exit 2; }
out=$1
shift
mkdir -p "$out"
cd "$out"
umask 077
days=825
if [ ! -f ca.key ]; then
  openssl req -x509 -newkey rsa:3072 -nodes -days "$days" -subj "/CN=trainwatch CA" \
    -keyout ca.key -out ca.crt 2>/dev/null
fi
sign() {  # sign NAME SAN USAGE
  openssl req -newkey rsa:2048 -nodes -subj "/CN=$1" -keyout "$1.key" -out "$1.csr" 2>/dev/null
  printf 'subjectAltName=%s\nextendedKeyUsage=%s\n' "$2" "$3" > "$1.ext"
  openssl x509 -req -in "$1.csr" -CA ca.crt -CAkey ca.key -CAcreateserial -days "$days" \
    -extfile "$1.ext" -out "$1.crt" 2>/dev/null
  rm -f "$1.csr" "$1.ext"
}
for name in "$@"; do
  case $name in
    *[!0-9.:]*) san="DNS:$name" ;;
    *) san="IP:$name" ;;
  esac
  sign "$name" "$san" serverAuth
done
sign prometheus "DNS:prometheus" clientAuth
chmod 644 ./*.crt
echo "in $out: ca.crt, $(printf '%s.crt/.key ' "$@")and prometheus.crt/.key"
