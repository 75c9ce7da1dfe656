#!/usr/bin/env bash
# Stop the one-node test cluster started by tests/slurm/start.sh: cancel its
# jobs, stop slurmd and slurmctld, and munged if start.sh started it; remove
# the /etc/slurm/slurm.conf that start.sh wrote. Only processes recorded in the
# state dir's pid files are signalled. Safe to run when nothing is running.
set -uo pipefail

dir=${FOURBIT_SLURM_DIR:-/var/tmp/fourbit-slurm}
conf=/etc/slurm/slurm.conf
marker="# written by fourbit tests/slurm/start.sh"
PATH=/usr/sbin:/usr/bin:/sbin:/bin:$PATH

ours_conf=0
[ -f "$conf" ] && grep -qF "$marker" "$conf" && ours_conf=1

alive() { [ -n "$1" ] && kill -0 "$1" 2>/dev/null; }
pid_of() { [ -s "$1" ] && tr -dc 0-9 <"$1"; }

stop_pid() { # name pidfile
    local pid
    pid=$(pid_of "$2") || return 0
    alive "$pid" || { rm -f "$2"; return 0; }
    kill -TERM "$pid" 2>/dev/null
    for _ in $(seq 50); do alive "$pid" || break; sleep 0.2; done
    if alive "$pid"; then
        echo "slurm stop: $1 ($pid) ignored SIGTERM, sending SIGKILL" >&2
        kill -KILL "$pid" 2>/dev/null
    fi
    rm -f "$2"
}

if [ "$ours_conf" = 1 ] && alive "$(pid_of "$dir/slurmctld.pid")"; then
    jobs=$(timeout 10 squeue -h -o %A 2>/dev/null | tr '\n' ' ')
    if [ -n "${jobs// /}" ]; then
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null
        for _ in $(seq 25); do
            [ -z "$(timeout 5 squeue -h -t running,completing -o %A 2>/dev/null)" ] && break
            sleep 0.2
        done
    fi
fi

stop_pid slurmd "$dir/slurmd.pid"
stop_pid slurmctld "$dir/slurmctld.pid"
if [ -f "$dir/munged.ours" ]; then
    stop_pid munged "$(head -n1 "$dir/munged.ours")"
    rm -f "$dir/munged.ours"
fi
[ "$ours_conf" = 1 ] && rm -f "$conf"
exit 0
