#!/usr/bin/env bash
# Print whether the cluster started by up.sh is up.  Exit 0 if it is, 1 if not.
set -uo pipefail
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
. "$HERE/common.sh"
nodes_arg "$@"
[ "$NODES" = 1 ] || exec bash "$HERE/multinode.sh" status "$NODES"

up=1
for d in $DAEMONS; do
    if pid=$(daemon_pid "$d"); then printf '  %-10s running (pid %s)\n' "$d" "$pid"
    else printf '  %-10s not running\n' "$d"; up=0; fi
done
if [ "$up" = 1 ] && timeout 10 sinfo >/dev/null 2>&1; then
    timeout 10 sinfo -N -o '%N %P %T %C %m' 2>/dev/null | sed 's/^/  /'
    st=$(timeout 10 sinfo -h -N -n "$(node_name)" -o '%T' 2>/dev/null | sed -n 1p)
    case "$st" in
        idle|mixed|allocated|completing) say "UP (partition $PPSPLIT_SLURM_PARTITION, node $(node_name) $st, state in $D)"; exit 0 ;;
    esac
    say "daemons running but node is '$st' (run up.sh to resume it)"; exit 1
fi
say "DOWN (state folder $D)"; exit 1
