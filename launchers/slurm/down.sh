#!/usr/bin/env bash
# Stop the daemons up.sh started, by their recorded PIDs only (TERM, then KILL
# after a bounded wait).  Idempotent: exits 0 when nothing is running.
# Keeps the state folder (job ids, accounting database) for the next up.sh;
# PPSPLIT_SLURM_WIPE=1 also deletes it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
. "$HERE/common.sh"

STOP_WAIT="${PPSPLIT_SLURM_STOP_WAIT:-30}"

# Cancel jobs still queued or running in our partition, so that no job steps
# (slurmstepd, started by our slurmd) outlive the cluster.
if daemon_pid slurmctld >/dev/null && [ "${PPSPLIT_SLURM_KEEP_JOBS:-0}" != 1 ]; then
    jobs=$(timeout 10 squeue -h -p "$PPSPLIT_SLURM_PARTITION" -o '%i' 2>/dev/null || true)
    if [ -n "$jobs" ]; then
        say "cancelling jobs: $(echo $jobs)"
        # shellcheck disable=SC2086
        timeout 10 scancel $jobs 2>/dev/null || true
        end=$(( $(date +%s) + 20 ))
        while [ -n "$(timeout 5 squeue -h -p "$PPSPLIT_SLURM_PARTITION" -o '%i' 2>/dev/null)" ] \
              && [ "$(date +%s)" -lt "$end" ]; do sleep 0.5; done
    fi
fi

stopped=0
for d in $(echo "$DAEMONS" | tr ' ' '\n' | tac); do
    pid=$(daemon_pid "$d") || { rm -f "$PIDS/$d.pid"; continue; }
    say "stopping $d (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    end=$(( $(date +%s) + STOP_WAIT ))
    while daemon_pid "$d" >/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
    if daemon_pid "$d" >/dev/null; then
        say "$d (pid $pid) still alive after ${STOP_WAIT}s; sending KILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
    rm -f "$PIDS/$d.pid"
    stopped=$((stopped + 1))
done

if [ "${PPSPLIT_SLURM_WIPE:-0}" = 1 ]; then
    say "removing state folder $D"
    rm -rf "$D"
fi
if [ "$stopped" = 0 ]; then say "nothing was running"; else say "stopped $stopped daemon(s)"; fi
