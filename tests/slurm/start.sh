#!/usr/bin/env bash
# Start a one-node SLURM cluster on this machine for tests/test_slurm.py:
# munged, slurmctld and slurmd as plain daemons (no systemd), no accounting
# (no slurmdbd), one partition `debug` holding this host. Needs root and
# Debian's slurm-wlm + munge (.ci/install-slurm.sh).
#
# The config is written to /etc/slurm/slurm.conf, the default path, on purpose:
# snakemake-executor-plugin-slurm-jobstep strips every SLURM_* variable
# (SLURM_CONF included) before its `srun`, so a config elsewhere is not found
# inside jobs. An existing slurm.conf not written by this script is never
# overwritten (FOURBIT_SLURM_FORCE=1 to override).
#
# Environment:
#   FOURBIT_SLURM_DIR      state, spool, logs and pid files (default /var/tmp/fourbit-slurm)
#   FOURBIT_SLURM_TIMEOUT  seconds to wait for the node to be idle (default 60)
#   FOURBIT_SLURM_MAXTIME  the partition's MaxTime (default 1-00:00:00: one day, above
#                          every runtime in profiles/slurm)
# Prints the state dir on success; stop with tests/slurm/stop.sh.
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
dir=${FOURBIT_SLURM_DIR:-/var/tmp/fourbit-slurm}
timeout=${FOURBIT_SLURM_TIMEOUT:-60}
maxtime=${FOURBIT_SLURM_MAXTIME:-1-00:00:00}
conf=/etc/slurm/slurm.conf
marker="# written by fourbit tests/slurm/start.sh"
PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

die() { echo "slurm start: $*" >&2; exit 1; }

[ "$(id -u)" = 0 ] || die "needs root (the daemons run as root; jobs run as the submitting user)"
for tool in munged munge slurmctld slurmd sinfo scontrol; do
    command -v "$tool" >/dev/null \
        || die "$tool not found: run .ci/install-slurm.sh (apt-get install slurm-wlm munge)"
done
if [ -e "$conf" ] && ! grep -qF "$marker" "$conf" && [ "${FOURBIT_SLURM_FORCE:-0}" != 1 ]; then
    die "$conf exists and was not written by this script; not touching a real" \
        "cluster's config (FOURBIT_SLURM_FORCE=1 overrides)"
fi

# A previous run of ours (or a crashed one) is stopped first: start from a clean state.
FOURBIT_SLURM_DIR=$dir "$here/stop.sh" >/dev/null 2>&1 || true

mkdir -p "$dir/ctld" "$dir/spool" "$dir/log"
chmod 755 "$dir"
rm -f "$dir"/log/*.log

# --- munge -------------------------------------------------------------------
if ! munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1; then
    install -d -o munge -g munge -m 0700 /etc/munge
    install -d -o munge -g munge -m 0755 /run/munge
    install -d -o munge -g munge -m 0700 /var/lib/munge /var/log/munge
    if [ ! -s /etc/munge/munge.key ]; then
        if command -v mungekey >/dev/null; then
            mungekey --create --keyfile=/etc/munge/munge.key
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1 count=1024 status=none
        fi
    fi
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
    # munged drops no privileges itself: run it as its own user, its pid file
    # where that user can write. munged.ours tells stop.sh it is ours to stop.
    runuser -u munge -- munged --pid-file=/run/munge/munged.pid \
        || die "munged did not start (see /var/log/munge/munged.log)"
    echo /run/munge/munged.pid >"$dir/munged.ours"
    for _ in $(seq 50); do
        munge -n </dev/null 2>/dev/null | unmunge >/dev/null 2>&1 && break
        sleep 0.2
    done
    munge -n </dev/null | unmunge >/dev/null || die "munge credentials do not round-trip"
fi

# --- slurm.conf ----------------------------------------------------------------
host=$(hostname -s)
# CPUs, sockets, cores, threads and RealMemory as slurmd itself measures them.
node=$(slurmd -C 2>/dev/null | head -n1 | sed "s/^NodeName=[^ ]*/NodeName=$host/")
case "$node" in NodeName=*CPUs=*RealMemory=*) ;; *) die "unexpected 'slurmd -C' output: $node" ;; esac
# Node features from the CPU's ISA, so that a profile's `constraint` (e.g. avx512f)
# selects a CPU type the way it does on a real cluster.
features=$(uname -m)
flags=$(grep -m1 '^flags' /proc/cpuinfo || true)
for flag in avx2 avx512f avx512_vnni avx512_bf16 amx_tile; do
    case " ${flags#*:} " in *" $flag "*) features="$features,$flag" ;; esac
done
mkdir -p /etc/slurm
cat >"$conf" <<EOF
$marker
# A one-node test cluster; stop it with tests/slurm/stop.sh. Not for production.
ClusterName=fourbit
SlurmctldHost=$host(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$dir/ctld
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
SlurmctldPort=6817
SlurmdPort=6818
# No cgroups, no systemd: plain process tracking, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
# No slurmdbd: nothing to account to. sacct cannot see jobs, so Snakemake's
# profile uses 'squeue', which sees finished jobs for MinJobAge seconds (the
# plugin wants >= 120 s; an hour here, so the test can read every finished
# job's record with scontrol show job).
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
MinJobAge=3600
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
# A request beyond every node/partition limit is rejected at submission with
# the scheduler's message, instead of pending forever.
EnforcePartLimits=ALL
ReturnToService=2
MpiDefault=none
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
$node NodeAddr=127.0.0.1 Features=$features State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=$maxtime State=UP
EOF

# --- daemons -------------------------------------------------------------------
# -c: clear saved state (jobs of an earlier run); -i: ignore unreadable state.
slurmctld -c -i || die "slurmctld did not start: $(tail -n 20 "$dir/log/slurmctld.log" 2>/dev/null)"
slurmd -c || die "slurmd did not start: $(tail -n 20 "$dir/log/slurmd.log" 2>/dev/null)"

deadline=$((SECONDS + timeout))
state=
while [ $SECONDS -lt $deadline ]; do
    state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
    case "$state" in
        idle) break ;;
        *drain* | *down*) scontrol update nodename="$host" state=resume >/dev/null 2>&1 || true ;;
    esac
    sleep 1
done
if [ "$state" != idle ]; then
    echo "slurm start: node $host is '${state:-unknown}' after ${timeout}s, not idle" >&2
    tail -n 20 "$dir/log/slurmctld.log" "$dir/log/slurmd.log" >&2 || true
    exit 1
fi
echo "$dir"
