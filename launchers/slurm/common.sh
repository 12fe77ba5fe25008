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
