# Shared settings and helpers for up.sh / down.sh / status.sh.  Sourced, not run.
# shellcheck shell=bash

PPSPLIT_SLURM_DIR="${PPSPLIT_SLURM_DIR:-/tmp/ppsplit-slurm}"
PPSPLIT_SLURM_CLUSTER="${PPSPLIT_SLURM_CLUSTER:-ppsplit}"
PPSPLIT_SLURM_PARTITION="${PPSPLIT_SLURM_PARTITION:-debug}"
PPSPLIT_SLURM_TIMEOUT="${PPSPLIT_SLURM_TIMEOUT:-120}"
PPSPLIT_SLURM_CPUS="${PPSPLIT_SLURM_CPUS:-8}"   # CPUs the node advertises (see up.sh)

D="$PPSPLIT_SLURM_DIR"
ETC="$D/etc"            # slurm.conf, slurmdbd.conf
PIDS="$D/pids"          # one <daemon>.pid per daemon we started
LOGS="$D/log"
RUN="$D/run"            # pid files the daemons write themselves
# The MariaDB client library (used by slurmdbd) finds the server on this
# default socket when StorageHost=localhost; the server has no TCP port.
MYSQL_SOCK_DIR=/run/mysqld
MYSQL_SOCK="$MYSQL_SOCK_DIR/mysqld.sock"
SYS_SLURM_CONF=/etc/slurm/slurm.conf   # Debian's default; a symlink to ours

# Daemons in start order; down.sh stops them in reverse order.
DAEMONS="mariadb munged slurmdbd slurmctld slurmd"

# Daemons read the config from the state folder; clients find it through
# the /etc/slurm/slurm.conf symlink.  slurmdbd reads slurmdbd.conf from the
# directory of $SLURM_CONF.
export SLURM_CONF="$ETC/slurm.conf"

say() { printf '[ppsplit-slurm] %s\n' "$*"; }
die() { printf '[ppsplit-slurm] ERROR: %s\n' "$*" >&2; exit 1; }

# Executable name we expect in /proc/PID/cmdline for each daemon (guards
# against a recorded PID that has been reused by an unrelated process).
daemon_exe() {
    case "$1" in
        mariadb) echo mariadbd ;;
        slurmd-*) echo slurmd ;;   # the multi-node cluster's slurmd-node1, ...
        *) echo "$1" ;;
    esac
}

# Print the recorded PID of daemon $1 if that process is alive and is the
# daemon; otherwise print nothing and return 1.
daemon_pid() {
    local f="$PIDS/$1.pid" pid exe
    [ -r "$f" ] || return 1
    pid=$(tr -dc 0-9 <"$f")
    [ -n "$pid" ] && [ -r "/proc/$pid/cmdline" ] || return 1
    exe=$(tr '\0' '\n' <"/proc/$pid/cmdline" | sed -n 1p)
    [ "$(basename -- "$exe")" = "$(daemon_exe "$1")" ] || return 1
    echo "$pid"
}

node_name() { hostname -s; }

# `--nodes N` of up.sh, down.sh and status.sh: 1 (the default) is the one-node cluster; 2 or
# more is the multi-node cluster of multinode.sh, which has its own state folder and ports.
nodes_arg() {
    NODES=1
    while [ $# -gt 0 ]; do
        case "$1" in
            --nodes) [ $# -ge 2 ] || die "--nodes needs a number"; NODES="$2"; shift 2 ;;
            --nodes=*) NODES="${1#--nodes=}"; shift ;;
            *) die "unknown argument '$1'; allowed: --nodes N" ;;
        esac
    done
    case "$NODES" in [1-9]) ;; *) die "--nodes $NODES: allowed: 1 to 9" ;; esac
}

# Cancel the jobs still queued or running in partition $1 (unless PPSPLIT_SLURM_KEEP_JOBS=1),
# so that no job step (slurmstepd, started by our slurmd) outlives the cluster; wait up to 20 s.
cancel_jobs() {
    local partition="$1" jobs end
    daemon_pid slurmctld >/dev/null && [ "${PPSPLIT_SLURM_KEEP_JOBS:-0}" != 1 ] || return 0
    jobs=$(timeout 10 squeue -h -p "$partition" -o '%i' 2>/dev/null || true)
    [ -n "$jobs" ] || return 0
    say "cancelling jobs: $(echo $jobs)"
    # shellcheck disable=SC2086
    timeout 10 scancel $jobs 2>/dev/null || true
    end=$(( $(date +%s) + 20 ))
    while [ -n "$(timeout 5 squeue -h -p "$partition" -o '%i' 2>/dev/null)" ] \
          && [ "$(date +%s)" -lt "$end" ]; do sleep 0.5; done
}

# A MariaDB data folder at $D/mysql, made once (its logs in $LOGS).
init_mariadb_datadir() {
    [ ! -d "$D/mysql/mysql" ] || return 0
    say "initialising MariaDB data dir $D/mysql"
    rm -rf "$D/mysql"; mkdir -p "$D/mysql"; chown mysql:mysql "$D/mysql"
    mariadb-install-db --no-defaults --user=mysql --datadir="$D/mysql" \
        --auth-root-authentication-method=socket --skip-test-db \
        >"$LOGS/mariadb-install.log" 2>&1 || die "mariadb-install-db failed (see $LOGS/mariadb-install.log)"
}

# Stop daemon $1 by its recorded PID: TERM, then KILL after PPSPLIT_SLURM_STOP_WAIT seconds.
# Returns 1 when it was not running.
stop_daemon() {
    local d="$1" pid end wait_s="${PPSPLIT_SLURM_STOP_WAIT:-30}"
    pid=$(daemon_pid "$d") || { rm -f "$PIDS/$d.pid"; return 1; }
    say "stopping $d (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    end=$(( $(date +%s) + wait_s ))
    while daemon_pid "$d" >/dev/null && [ "$(date +%s)" -lt "$end" ]; do sleep 0.2; done
    if daemon_pid "$d" >/dev/null; then
        say "$d (pid $pid) still alive after ${wait_s}s; sending KILL"
        kill -KILL "$pid" 2>/dev/null || true; sleep 0.5
    fi
    rm -f "$PIDS/$d.pid"
}
