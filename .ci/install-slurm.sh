#!/usr/bin/env bash
# CI: install a one-node SLURM (Debian's slurm-wlm) and munge for tests/test_slurm.py.
# Idempotent and quiet: does nothing when the daemons and client tools are already there.
# Installs only; tests/slurm/start.sh writes the config and starts the daemons
# (no systemd), tests/slurm/stop.sh stops them.
set -euo pipefail

needed=(slurmctld slurmd sbatch squeue sinfo munged)
missing=0
for tool in "${needed[@]}"; do
    command -v "$tool" >/dev/null 2>&1 || [ -x "/usr/sbin/$tool" ] || missing=1
done
if [ "$missing" = 0 ]; then
    exit 0
fi

if [ "$(id -u)" != 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo -n "$0" "$@"
    fi
    echo "install-slurm: needs root (or passwordless sudo) to apt-get install slurm-wlm munge" >&2
    exit 1
fi

export DEBIAN_FRONTEND=noninteractive
# The packages' maintainer scripts would start munge/slurm services; the test
# starts its own daemons, so forbid that while installing (unless the image
# already has a policy, as Docker images do).
policy=/usr/sbin/policy-rc.d
if [ ! -e "$policy" ]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy"
    chmod +x "$policy"
    trap 'rm -f "$policy"' EXIT
fi

log=$(mktemp)
apt_get() { apt-get -q -y -o Dpkg::Use-Pty=0 "$@" >>"$log" 2>&1; }
install() { apt_get install --no-install-recommends slurm-wlm munge; }
if ! install && ! { apt_get update && install; }; then
    cat "$log" >&2
    echo "install-slurm: apt-get install slurm-wlm munge failed (log above)" >&2
    exit 1
fi
rm -f "$log"
echo "install-slurm: $(slurmctld -V 2>&1), $(munged -V 2>&1 | cut -d' ' -f1)"
