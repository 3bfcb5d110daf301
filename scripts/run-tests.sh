#!/usr/bin/env bash
# Run the test suite in a private network namespace that has only loopback.
#
#   bash scripts/run-tests.sh [pytest args...]     (what `make test` calls)
#
# Nothing a test starts can then reach any address but 127.0.0.1, whatever interface a
# library binds (Mooncake and torch's TCPStore listen on every interface). Where the kernel
# allows it the namespace also gets its own PID space, so every process a test leaks is
# killed when pytest exits. Order of attempts:
#   1. unshare --net --pid --fork --mount-proc --kill-child   (root: loopback only, no leaks)
#   2. unshare --net                                          (root: loopback only)
#   3. unshare --user --map-root-user --net                   (no root, user namespaces allowed)
#   4. no namespace: pytest runs directly with the same loopback settings (said so loudly).
# Inside, `lo` is brought up with `ip` (iproute2), or with a SIOCSIFFLAGS ioctl from Python
# where `ip` is missing (`make sysdeps` installs iproute2 only together with the RDMA libraries).
#
# Exit status: pytest's. "No tests collected" (pytest's 5) is reported as a failure.
set -euo pipefail

SELF="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/$(basename "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.."
PY=.venv/bin/python
say() { echo "run-tests: $*" >&2; }

if [[ ! -x "$PY" ]]; then
  say "$PY not found; run 'make setup' first"
  exit 2
fi

# Loopback-only settings, exported before entering the namespace so both paths share them.
export GLOO_SOCKET_IFNAME=lo
export MC_TCP_BIND_ADDRESS=127.0.0.1
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
export NO_PROXY='*' no_proxy='*'

bring_up_loopback() {
  if command -v ip >/dev/null 2>&1; then
    ip link set lo up
  else
    say "'ip' not found; bringing lo up with an ioctl"
    "$PY" - <<'EOF'
import fcntl, socket, struct

SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    req = struct.pack("16sH22x", b"lo", 0)
    flags = struct.unpack("16sH22x", fcntl.ioctl(s, SIOCGIFFLAGS, req))[1]
    fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH22x", b"lo", flags | IFF_UP))
EOF
  fi
  # Fail early, with a clear message, if loopback is still unusable.
  "$PY" -c '
import socket
with socket.create_server(("127.0.0.1", 0)) as srv:
    socket.create_connection(srv.getsockname(), timeout=5).close()
' || { say "loopback is not usable inside the namespace"; exit 2; }
}

run_pytest() {
  say "running: $PY -m pytest -q $*"
  local rc=0
  "$PY" -m pytest -q "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    say "FAILED: pytest collected no tests (exit 5); check the paths and -k/-m filters: $*"
  fi
  exit "$rc"
}

# Second stage: we are inside the namespace.
if [[ "${_CPSERVE_IN_NETNS:-0}" == 1 ]]; then
  unset _CPSERVE_IN_NETNS
  bring_up_loopback
  local_ifs=$("$PY" -c 'import socket; print(*(name for _, name in socket.if_nameindex()))')
  say "inside a private network namespace (interfaces: $local_ifs)"
  export CPSERVE_NETNS=1
  run_pytest "$@"
fi

# First stage: pick the strongest isolation this machine allows.
modes=(
  "unshare --net --pid --fork --mount-proc --kill-child"
  "unshare --net"
  "unshare --user --map-root-user --net"
)
if command -v unshare >/dev/null 2>&1; then
  for mode in "${modes[@]}"; do
    if $mode "$BASH" -c : >/dev/null 2>&1; then
      say "entering a loopback-only network namespace: $mode"
      _CPSERVE_IN_NETNS=1 exec $mode "$BASH" "$SELF" "$@"
    fi
  done
fi

say "WARNING: cannot create a private network namespace (unshare refused or missing);"
say "WARNING: tests run WITHOUT one, relying on the 127.0.0.1 settings alone"
export CPSERVE_NETNS=0
run_pytest "$@"
