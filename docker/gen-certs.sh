#!/usr/bin/env bash
# Generate TEST TLS material (ECDSA P-384) and SuperNode authentication keys for a Flower 1.41 federation.
#
#   docker/gen-certs.sh OUT_DIR [--supernodes N] [--san DNS:name|IP:addr]... [--days D]
#
# Creates (and on re-runs keeps; see "Idempotency"):
#   OUT_DIR/ca.crt, ca.key                     test CA (the `root-certificates` of SuperNodes,
#                                              the flwr CLI and the ServerApp SuperExec)
#   OUT_DIR/superlink/server.pem, server.key   SuperLink certificate. SAN: localhost, superlink,
#                                              superexec-serverapp, supernode-1..N,
#                                              superexec-clientapp-1..N (the compose service
#                                              names), 127.0.0.1, ::1, plus every --san
#   OUT_DIR/supernode-<i>/runtime.pem, .key    certificate of SuperNode i's local Runtime API
#                                              (used by its ClientApp SuperExec in process
#                                              isolation). SAN: supernode-<i>, supernode, localhost,
#                                              127.0.0.1, ::1
#   OUT_DIR/keys/supernode-<i>, .pub           SuperNode authentication key pair: OpenSSH-format
#                                              ECDSA P-384 (flwr 1.41 `--auth-supernode-private-key`
#                                              / `flwr supernode register <key.pub>`)
#   OUT_DIR/supernodes.csv                     name,partition_id,public_key_file,sha256_fingerprint,
#                                              public_key (bookkeeping / registration list)
#   OUT_DIR/register-supernodes.sh             `flwr supernode register` for every key
#   OUT_DIR/cli/config.toml                    flwr CLI connection `compose` for use inside the
#                                              compose network (root-certificates at
#                                              /app/certificates/ca.crt)
#
# Flower 1.41 has no CSV allow-list any more (`flower-superlink --auth-list-public-keys` is
# deprecated and aborts): with `--enable-supernode-auth`, every SuperNode public key must be
# registered through the Control API with `flwr supernode register`; supernodes.csv is only the
# operator's record of which key belongs to which node/partition.
#
# Idempotency: existing keys and the CA are never regenerated. A leaf certificate is re-issued
# only if it is missing, does not verify against the CA, or its SAN list differs from the one
# requested now. Re-running with the same arguments changes nothing.
#
# These are TEST certificates (self-made CA). In production use your organisation's CA; the
# SAN rules above still apply (the ServerApp SuperExec in `subprocess` isolation connects to
# 127.0.0.1, so keep IP:127.0.0.1 in the SuperLink certificate).
set -euo pipefail

usage() { sed -n '2,4p' "$0" >&2; exit 2; }

[[ $# -ge 1 ]] || usage
OUT=$1; shift
N=2
DAYS=365
EXTRA_SANS=()
while [[ $# -gt 0 ]]; do
    case $1 in
        --supernodes) N=${2:?}; shift 2 ;;
        --san) EXTRA_SANS+=("${2:?}"); shift 2 ;;
        --days) DAYS=${2:?}; shift 2 ;;
        -h|--help) usage ;;
        *) echo "unknown argument: $1" >&2; usage ;;
    esac
done
[[ $N =~ ^[0-9]+$ && $N -ge 1 ]] || { echo "--supernodes must be an integer >= 1" >&2; exit 2; }
for san in "${EXTRA_SANS[@]}"; do
    [[ $san =~ ^(DNS|IP):[A-Za-z0-9.:*-]+$ ]] || { echo "--san must look like DNS:name or IP:addr, got '$san'" >&2; exit 2; }
done
command -v openssl >/dev/null || { echo "openssl is required" >&2; exit 1; }
command -v ssh-keygen >/dev/null || { echo "ssh-keygen is required" >&2; exit 1; }

umask 077
mkdir -p "$OUT" "$OUT/superlink" "$OUT/keys" "$OUT/cli"
OUT=$(cd "$OUT" && pwd)

# ---------------------------------------------------------------- CA
if [[ ! -s $OUT/ca.key || ! -s $OUT/ca.crt ]]; then
    openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-384 -out "$OUT/ca.key"
    openssl req -new -x509 -key "$OUT/ca.key" -sha256 -days "$DAYS" \
        -subj "/CN=fl-dp-flower test CA" -out "$OUT/ca.crt"
    echo "created CA $OUT/ca.crt"
fi

# ---------------------------------------------------------------- leaf certificates
# issue NAME DIR BASENAME SAN1 SAN2 ...
issue() {
    local cn=$1 dir=$2 base=$3; shift 3
    local sans; sans=$(IFS=,; echo "$*")
    mkdir -p "$dir"
    if [[ -s $dir/$base.pem && -s $dir/$base.key && -s $dir/$base.san ]] \
        && [[ "$(cat "$dir/$base.san")" == "$sans" ]] \
        && openssl verify -CAfile "$OUT/ca.crt" "$dir/$base.pem" >/dev/null 2>&1; then
        return 0
    fi
    local cnf; cnf=$(mktemp)
    local dns=0 ip=0
    {
        echo "[req]"; echo "distinguished_name = dn"; echo "req_extensions = v3_req"; echo "prompt = no"
        echo "[dn]"; echo "CN = $cn"
        echo "[v3_req]"
        echo "basicConstraints = CA:FALSE"
        echo "keyUsage = critical, digitalSignature"
        echo "extendedKeyUsage = serverAuth"
        echo "subjectAltName = @alt"
        echo "[alt]"
        for san in "$@"; do
            case $san in
                DNS:*) dns=$((dns + 1)); echo "DNS.$dns = ${san#DNS:}" ;;
                IP:*) ip=$((ip + 1)); echo "IP.$ip = ${san#IP:}" ;;
            esac
        done
    } > "$cnf"
    [[ -s $dir/$base.key ]] || openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-384 -out "$dir/$base.key"
    openssl req -new -key "$dir/$base.key" -out "$dir/$base.csr" -config "$cnf"
    openssl x509 -req -in "$dir/$base.csr" -CA "$OUT/ca.crt" -CAkey "$OUT/ca.key" -CAcreateserial \
        -out "$dir/$base.pem" -days "$DAYS" -sha256 -extfile "$cnf" -extensions v3_req 2>/dev/null
    rm -f "$dir/$base.csr" "$cnf"
    openssl verify -CAfile "$OUT/ca.crt" "$dir/$base.pem" >/dev/null
    echo "$sans" > "$dir/$base.san"
    echo "issued $dir/$base.pem (SAN $sans)"
}

LINK_SANS=(DNS:localhost DNS:superlink DNS:superexec-serverapp)
for i in $(seq 1 "$N"); do LINK_SANS+=("DNS:supernode-$i" "DNS:superexec-clientapp-$i"); done
LINK_SANS+=(IP:127.0.0.1 IP:::1 "${EXTRA_SANS[@]}")
issue superlink "$OUT/superlink" server "${LINK_SANS[@]}"

for i in $(seq 1 "$N"); do
    issue "supernode-$i" "$OUT/supernode-$i" runtime "DNS:supernode-$i" DNS:supernode DNS:localhost IP:127.0.0.1 IP:::1
done

# ---------------------------------------------------------------- SuperNode auth keys
CSV=$OUT/supernodes.csv
echo "name,partition_id,public_key_file,sha256_fingerprint,public_key" > "$CSV.tmp"
for i in $(seq 1 "$N"); do
    key=$OUT/keys/supernode-$i
    if [[ ! -s $key || ! -s $key.pub ]]; then
        rm -f "$key" "$key.pub"
        ssh-keygen -q -t ecdsa -b 384 -N "" -C "supernode-$i" -f "$key"
        echo "created SuperNode key $key (.pub)"
    fi
    fp=$(ssh-keygen -l -E sha256 -f "$key.pub" | awk '{print $2}')
    pub=$(awk '{print $1" "$2}' "$key.pub")
    echo "supernode-$i,$((i - 1)),keys/supernode-$i.pub,$fp,$pub" >> "$CSV.tmp"
done
mv "$CSV.tmp" "$CSV"

cat > "$OUT/register-supernodes.sh" <<'EOF'
#!/usr/bin/env bash
# Register every SuperNode public key listed in supernodes.csv with the SuperLink.
#   register-supernodes.sh CONNECTION     (a [superlink.CONNECTION] entry of $FLWR_HOME/config.toml)
# Keys that are already registered are reported by the SuperLink and skipped (exit code kept 0).
# Flower 1.41 answers a key revoked by `flwr supernode unregister` the same way ("Public key already
# in use"): such a key can never be registered again; give that node a new key (docs/deployment.md §2.4).
set -uo pipefail
CONN=${1:?usage: register-supernodes.sh CONNECTION}
HERE=$(cd "$(dirname "$0")" && pwd)
rc=0
while IFS=, read -r name pid keyfile fp pub; do
    out=$(flwr supernode register "$HERE/$keyfile" "$CONN" --name "$name" 2>&1)
    status=$?
    echo "$name ($fp): $out"
    if [[ $status -ne 0 ]] && grep -qi "already" <<<"$out"; then
        echo "  -> skipped: registered already, or revoked earlier (then it is 'unregistered' in flwr supernode ls and needs a new key)"
    elif [[ $status -ne 0 ]]; then rc=1; fi
done < <(tail -n +2 "$HERE/supernodes.csv")
exit $rc
EOF
chmod 755 "$OUT/register-supernodes.sh"

cat > "$OUT/cli/config.toml" <<'EOF'
# flwr CLI configuration for use INSIDE the compose network (FLWR_HOME=/app/cli).
[superlink]
default = "compose"

[superlink.compose]
address = "superlink:8000"
root-certificates = "/app/certificates/ca.crt"
EOF

# public material world-readable, private keys owner-only
chmod 644 "$OUT/ca.crt" "$OUT/superlink/server.pem" "$OUT"/supernode-*/runtime.pem "$OUT"/keys/*.pub \
    "$CSV" "$OUT/cli/config.toml" "$OUT"/superlink/*.san "$OUT"/supernode-*/*.san
chmod 600 "$OUT/ca.key" "$OUT/superlink/server.key" "$OUT"/supernode-*/runtime.key
for i in $(seq 1 "$N"); do chmod 600 "$OUT/keys/supernode-$i"; done
chmod 755 "$OUT" "$OUT/superlink" "$OUT/keys" "$OUT/cli" "$OUT"/supernode-*
echo "TLS material and SuperNode keys in $OUT"
