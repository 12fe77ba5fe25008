#!/usr/bin/env bash
# Stop the daemons up.sh started, by their recorded PIDs only (TERM, then KILL
# after a bounded wait).  Idempotent: exits 0 when nothing is running.
# Keeps the state folder (job ids, accounting database) for the next up.sh;
# PPSPLIT_SLURM_WIPE=1 also deletes it.
set -euo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
. "$HERE/common.sh"
nodes_arg "$@"
[ "$NODES" = 1 ] || exec bash "$HERE/multinode.sh" down "$NODES"

cancel_jobs "$PPSPLIT_SLURM_PARTITION"

stopped=0
for d in $(echo "$DAEMONS" | tr ' ' '\n' | tac); do
    stop_daemon "$d" && stopped=$((stopped + 1))
done

if [ "${PPSPLIT_SLURM_WIPE:-0}" = 1 ]; then
    say "removing state folder $D"
    rm -rf "$D"
fi
if [ "$stopped" = 0 ]; then say "nothing was running"; else say "stopped $stopped daemon(s)"; fi
