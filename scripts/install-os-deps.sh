#!/usr/bin/env bash
# Installs the Debian packages the test suite drives for real, when they are missing.
set -euo pipefail
need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
# Sentinel failover in tests/test_redis_topologies.py (Debian's redis-sentinel: the same binary).
command -v redis-sentinel >/dev/null 2>&1 || need+=(redis-sentinel)
# Throwaway certificates for the TLS Redis test (extproc_lab/demo/certificates.py).
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# kubectl renders k8s/ (kubectl kustomize). The machine image ships kubectl 1.32 (kustomize v5);
# Debian's kubernetes-client is the fallback, and k8s/ needs kustomize v4+ (kubectl 1.21+).
command -v kubectl >/dev/null 2>&1 || need+=(kubernetes-client)
# wrk drives `extproc bench overhead` (and its short run in the suite).
command -v wrk >/dev/null 2>&1 || need+=(wrk)
if [ ${#need[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "missing OS packages: ${need[*]} (run as root, or: sudo apt-get install ${need[*]})" >&2
  exit 0
fi
echo "installing OS packages: ${need[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update -q >/dev/null
apt-get install -y -q --no-install-recommends "${need[@]}" >/dev/null
