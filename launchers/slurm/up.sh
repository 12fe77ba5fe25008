#!/usr/bin/env bash
# Bring up a single-node SLURM cluster (with accounting) on this machine.
# Idempotent: when everything is already up it only checks and exits 0.
# See README.md in this folder.
set -euo pipefail
export DEBIAN_FRONTEND=noninteractive
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
# shellcheck source=common.sh
. "$HERE/common.sh"
nodes_arg "$@"

[ "$(id -u)" = 0 ] || die "must run as root"
T0=$(date +%s)
elapsed() { echo "$(( $(date +%s) - T0 ))s"; }

# Wait until "$@" succeeds, at most $PPSPLIT_SLURM_TIMEOUT seconds.
wait_for() {
    local what="$1"; shift
    local end=$(( $(date +%s) + PPSPLIT_SLURM_TIMEOUT ))
    until "$@" >/dev/null 2>&1; do
        if [ "$(date +%s)" -ge "$end" ]; then
            die "timed out after ${PPSPLIT_SLURM_TIMEOUT}s waiting for $what (logs: $LOGS)"
        fi
        sleep 0.3
    done
}

# ---------------------------------------------------------------- packages
PKGS="slurmctld slurmd slurm-client munge slurmdbd mariadb-server"

missing_pkgs() {
    local p out=""
    for p in $PKGS; do
        dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep 'install ok installed' >/dev/null \
            || out="$out $p"
    done
    echo "$out"
}

POLICY=/usr/sbin/policy-rc.d
POLICY_BACKUP=""
POLICY_CREATED=0
restore_policy() {
    if [ "$POLICY_CREATED" = 1 ]; then rm -f "$POLICY"; fi
    if [ -n "$POLICY_BACKUP" ]; then mv -f "$POLICY_BACKUP" "$POLICY"; fi
    POLICY_CREATED=0; POLICY_BACKUP=""
}

install_pkgs() {
    local missing; missing=$(missing_pkgs)
    [ -n "$missing" ] || return 0
    say "installing:$missing"
    local t=$(date +%s)
    # Keep package scripts from starting services (no systemd here); we start
    # the daemons ourselves.  Leave an existing policy-rc.d that already says 101.
    trap restore_policy EXIT; trap 'restore_policy; exit 130' INT TERM
    if [ -e "$POLICY" ]; then
        if ! { "$POLICY" x start >/dev/null 2>&1; [ $? = 101 ]; }; then
            POLICY_BACKUP="$POLICY.ppsplit-saved"; mv -f "$POLICY" "$POLICY_BACKUP"
        fi
    fi
    if [ ! -e "$POLICY" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$POLICY"; chmod 755 "$POLICY"; POLICY_CREATED=1
    fi
    local apt_opts=(-y -q -o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold
                    --no-install-recommends)
    local need_update=0 p
    for p in $missing; do
        apt-cache policy "$p" 2>/dev/null | grep 'Candidate: [0-9]' >/dev/null || need_update=1
    done
    if [ "$need_update" = 1 ]; then
        say "apt-get update"; apt-get update -q </dev/null >"$D/apt.log" 2>&1 \
            || die "apt-get update failed (see $D/apt.log)"
    fi
    # shellcheck disable=SC2086
    if ! apt-get install "${apt_opts[@]}" $missing </dev/null >>"$D/apt.log" 2>&1; then
        [ "$need_update" = 0 ] || die "apt-get install failed (see $D/apt.log)"
        say "install failed with the current package lists; apt-get update and retry"
        apt-get update -q </dev/null >>"$D/apt.log" 2>&1 || die "apt-get update failed (see $D/apt.log)"
        # shellcheck disable=SC2086
        apt-get install "${apt_opts[@]}" $missing </dev/null >>"$D/apt.log" 2>&1 \
            || die "apt-get install failed (see $D/apt.log)"
    fi
    restore_policy; trap - EXIT INT TERM
    say "packages installed in $(( $(date +%s) - t ))s"
}

if [ "$NODES" != 1 ]; then
    mkdir -p "$D"
    command -v slurmctld >/dev/null 2>&1 && [ -z "$(missing_pkgs)" ] || install_pkgs
    exec bash "$HERE/multinode.sh" up "$NODES"
fi

# ---------------------------------------------------------------- fast path
all_up() {
    local d
    for d in $DAEMONS; do daemon_pid "$d" >/dev/null || return 1; done
    [ -e "$SYS_SLURM_CONF" ] && [ "$(readlink -f "$SYS_SLURM_CONF")" = "$(readlink -f "$ETC/slurm.conf")" ] \
        || return 1
    scontrol ping 2>/dev/null | grep 'is UP' >/dev/null || return 1
}

node_state() { sinfo -h -N -n "$(node_name)" -o '%T' 2>/dev/null | sed -n 1p; }

# Node states in which the node accepts work; anything else gets a resume.
node_ok() {
    case "$(node_state)" in
        idle|mixed|allocated|completing) return 0 ;;
        *) return 1 ;;
    esac
}

resume_node_if_needed() {
    local st; st=$(node_state)
    case "$st" in
        *drain*|*down*|*fail*|*inval*|*maint*)
            say "node $(node_name) is $st; resuming"
            scontrol update nodename="$(node_name)" state=resume 2>/dev/null || true ;;
    esac
}

mkdir -p "$D"
if command -v slurmctld >/dev/null 2>&1 && [ -z "$(missing_pkgs)" ] && all_up; then
    resume_node_if_needed
    if node_ok; then
        say "already up (partition $PPSPLIT_SLURM_PARTITION, node $(node_name), state $(node_state)); nothing to do"
        exit 0
    fi
    say "daemons up but node is '$(node_state)'; checking it"
fi

install_pkgs

# ---------------------------------------------------------------- state folder
# The slurmctld state (job ids, queue) and the accounting database belong
# together; keep both across down/up, wipe both when either is missing or
# when PPSPLIT_SLURM_FRESH=1 (and nothing is running).
any_running() { local d; for d in $DAEMONS; do daemon_pid "$d" >/dev/null && return 0; done; return 1; }
if ! any_running; then
    if [ "${PPSPLIT_SLURM_FRESH:-0}" = 1 ] || [ ! -d "$D/mysql/mysql" ] || [ ! -f "$D/first_job_id" ] \
            || [ ! -d "$D/state/ctld" ]; then
        if [ -e "$D/mysql" ] || [ -e "$D/state" ]; then say "clearing old state in $D"; fi
        rm -rf "$D/mysql" "$D/state" "$D/spool" "$RUN" "$PIDS" "$D/first_job_id"
    fi
fi
mkdir -p "$ETC" "$PIDS" "$LOGS" "$RUN" "$D/state/ctld" "$D/spool/slurmd"
chmod 755 "$D"
# Job ids: start from a clock-derived number on a fresh state folder so that
# ids do not restart at 1 (old submitit folders named after job ids would be
# mistaken for results of new jobs).
[ -f "$D/first_job_id" ] || echo $(( ($(date +%s) % 50000000) + 1000 )) >"$D/first_job_id"
FIRST_JOB_ID=$(cat "$D/first_job_id")

# ---------------------------------------------------------------- configs
NODE=$(node_name)
# First line of `slurmd -C`: NodeName=... CPUs=... RealMemory=...; keep 90%
# of the memory (more than the real memory sends the node to INVAL/DRAIN).
NODE_LINE=$(slurmd -C 2>/dev/null | sed -n 1p)
case "$NODE_LINE" in NodeName=*) ;; *) die "unexpected 'slurmd -C' output: $NODE_LINE" ;; esac
MEM=$(sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
NODE_LINE=$(sed "s/RealMemory=[0-9]*/RealMemory=$(( MEM * 9 / 10 ))/; s/^NodeName=[^ ]*/NodeName=$NODE/" <<<"$NODE_LINE")
# Advertise PPSPLIT_SLURM_CPUS CPUs (default 8, never fewer than the real ones) so that a
# 4- or 8-rank pipeline, or several sweep points at once, fit on this small node: ranks of
# the tiny test models are mostly idle, waiting on each other. config_overrides makes
# slurmd accept a node description larger than the hardware.
REAL_CPUS=$(sed -n 's/.* CPUs=\([0-9]*\).*/\1/p' <<<"$NODE_LINE")
CPUS=$PPSPLIT_SLURM_CPUS
[ "$CPUS" -ge "$REAL_CPUS" ] || CPUS=$REAL_CPUS
NODE_LINE=$(sed -E "s/ CPUs=[0-9]+/ CPUs=$CPUS/; s/ Boards=[0-9]+//; s/ SocketsPerBoard=[0-9]+/ SocketsPerBoard=1/; s/ CoresPerSocket=[0-9]+/ CoresPerSocket=$CPUS/; s/ ThreadsPerCore=[0-9]+/ ThreadsPerCore=1/" <<<"$NODE_LINE")

write_if_changed() {  # file mode < content
    local f="$1" mode="$2" tmp; tmp=$(mktemp "$f.XXXXXX")
    cat >"$tmp"; chmod "$mode" "$tmp"
    if [ -f "$f" ] && cmp -s "$tmp" "$f"; then rm -f "$tmp"; else mv -f "$tmp" "$f"; fi
}

write_if_changed "$ETC/slurm.conf" 644 <<EOF
# Written by ppsplit launchers/slurm/up.sh -- regenerated on every start.
ClusterName=$PPSPLIT_SLURM_CLUSTER
SlurmctldHost=localhost(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
# Bind daemons to 127.0.0.1 (what localhost/the node name resolve to), not 0.0.0.0.
CommunicationParameters=NoCtldInAddrAny,NoInAddrAny
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
MailProg=/bin/true
FirstJobId=$FIRST_JOB_ID
StateSaveLocation=$D/state/ctld
SlurmdSpoolDir=$D/spool/slurmd
SlurmctldPidFile=$RUN/slurmctld.pid
SlurmdPidFile=$RUN/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=10
MinJobAge=300
# A preempted job is signalled first (SIGUSR2, submitit's), as a job near its time limit is.
SlurmctldParameters=preempt_send_user_signal
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobAcctGatherType=jobacct_gather/linux
JobAcctGatherFrequency=30
JobCompType=jobcomp/none
$NODE_LINE NodeAddr=127.0.0.1 State=UNKNOWN
PartitionName=$PPSPLIT_SLURM_PARTITION Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
EOF

write_if_changed "$ETC/slurmdbd.conf" 600 <<EOF
# Written by ppsplit launchers/slurm/up.sh -- regenerated on every start.
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
CommunicationParameters=NoInAddrAny
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=$RUN/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
EOF

# Plain sinfo/sbatch (and submitit) read Debian's default path.
mkdir -p /etc/slurm
if [ -e "$SYS_SLURM_CONF" ] && [ ! -L "$SYS_SLURM_CONF" ] && [ ! -e "$SYS_SLURM_CONF.ppsplit-saved" ]; then
    say "saving existing $SYS_SLURM_CONF as $SYS_SLURM_CONF.ppsplit-saved"
    mv "$SYS_SLURM_CONF" "$SYS_SLURM_CONF.ppsplit-saved"
fi
ln -sfn "$ETC/slurm.conf" "$SYS_SLURM_CONF"

# ---------------------------------------------------------------- start helpers
# start NAME cmd...: run cmd in its own session in the background, record PID.
start() {
    local name="$1"; shift
    if daemon_pid "$name" >/dev/null; then say "$name already running (pid $(daemon_pid "$name"))"; return 0; fi
    setsid "$@" </dev/null >>"$LOGS/$name.out" 2>&1 &
    local pid=$!
    echo "$pid" >"$PIDS/$name.pid"
    sleep 0.2
    daemon_pid "$name" >/dev/null || die "$name exited at once (see $LOGS/$name.out and $LOGS/$name.log)"
    say "started $name (pid $pid)"
}

port_busy() { ss -Hltn "sport = :$1" 2>/dev/null | grep . >/dev/null; }
check_port() {  # daemon port
    daemon_pid "$1" >/dev/null && return 0
    port_busy "$2" && die "port $2 is in use by a process this script did not start; is another SLURM running? ($(ss -Hltnp "sport = :$2" | sed -n 1p))"
    return 0
}

# ---------------------------------------------------------------- mariadb
if ! daemon_pid mariadb >/dev/null; then
    if [ -S "$MYSQL_SOCK" ] && mariadb --no-defaults --socket="$MYSQL_SOCK" -e 'select 1' >/dev/null 2>&1; then
        die "a MariaDB server this script did not start already listens on $MYSQL_SOCK"
    fi
    init_mariadb_datadir
    # mariadbd drops to the mysql user: its socket/pid dir and log must be writable.
    mkdir -p "$MYSQL_SOCK_DIR"; chown mysql:mysql "$MYSQL_SOCK_DIR"; rm -f "$MYSQL_SOCK"
    touch "$LOGS/mariadb.log"; chown mysql:mysql "$LOGS/mariadb.log"
    start mariadb /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$D/mysql" \
        --socket="$MYSQL_SOCK" --skip-networking --pid-file="$MYSQL_SOCK_DIR/ppsplit-mariadb.pid" \
        --log-error="$LOGS/mariadb.log" --innodb-buffer-pool-size=64M \
        --innodb-log-file-size=16M
else
    say "mariadb already running (pid $(daemon_pid mariadb))"
fi
wait_for "MariaDB on $MYSQL_SOCK" mariadb --no-defaults --socket="$MYSQL_SOCK" -e 'select 1'

# ---------------------------------------------------------------- munge
munge_works() { munge -n 2>/dev/null | unmunge >/dev/null 2>&1; }
if ! daemon_pid munged >/dev/null; then
    munge_works && die "a munged this script did not start is already running"
    if [ ! -s /etc/munge/munge.key ]; then
        say "creating /etc/munge/munge.key"
        mkdir -p /etc/munge
        dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
    fi
    chown munge:munge /etc/munge /etc/munge/munge.key; chmod 0700 /etc/munge; chmod 0400 /etc/munge/munge.key
    mkdir -p /run/munge /var/lib/munge /var/log/munge
    chown munge:munge /run/munge /var/lib/munge /var/log/munge
    chmod 0755 /run/munge; chmod 0700 /var/lib/munge /var/log/munge
    start munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F --force
else
    say "munged already running (pid $(daemon_pid munged))"
fi
wait_for "munged" munge_works

# ---------------------------------------------------------------- slurmdbd
check_port slurmdbd 6819
start slurmdbd /usr/sbin/slurmdbd -D
wait_for "slurmdbd" sacctmgr -n list cluster
if ! sacctmgr -n -P list cluster format=cluster | grep -x "$PPSPLIT_SLURM_CLUSTER" >/dev/null; then
    say "registering cluster $PPSPLIT_SLURM_CLUSTER in accounting"
    sacctmgr -i add cluster "$PPSPLIT_SLURM_CLUSTER" >/dev/null
fi
if ! sacctmgr -n -P list account format=account | grep -x ppsplit >/dev/null; then
    sacctmgr -i add account ppsplit cluster="$PPSPLIT_SLURM_CLUSTER" Description=ppsplit Organization=ppsplit >/dev/null
fi
if ! sacctmgr -n -P list user root format=user,defaultaccount | grep '^root|ppsplit$' >/dev/null; then
    sacctmgr -i add user root account=ppsplit defaultaccount=ppsplit cluster="$PPSPLIT_SLURM_CLUSTER" >/dev/null 2>&1 || true
fi

# ---------------------------------------------------------------- slurmctld
check_port slurmctld 6817
start slurmctld /usr/sbin/slurmctld -D -i
wait_for "slurmctld" sh -c 'scontrol ping | grep "is UP" >/dev/null'

# ---------------------------------------------------------------- slurmd
check_port slurmd 6818
start slurmd /usr/sbin/slurmd -D
end=$(( $(date +%s) + PPSPLIT_SLURM_TIMEOUT ))
until node_ok; do
    resume_node_if_needed
    [ "$(date +%s)" -lt "$end" ] || die "node $NODE not idle after ${PPSPLIT_SLURM_TIMEOUT}s (state '$(node_state)'; logs: $LOGS)"
    sleep 0.5
done
say "node $NODE is $(node_state) ($(elapsed))"

# ---------------------------------------------------------------- smoke test
# A smoke job recovered from the state of a crashed slurmctld can hold a CPU
# until its 1-minute limit; it is ours, cancel it.
scancel --name=ppsplit-smoke 2>/dev/null || true
say "smoke test: srun -N1 -n1 true"
timeout "$PPSPLIT_SLURM_TIMEOUT" srun -N1 -n1 -t 1 -J ppsplit-smoke -p "$PPSPLIT_SLURM_PARTITION" true </dev/null \
    || die "smoke-test job did not complete within ${PPSPLIT_SLURM_TIMEOUT}s (logs: $LOGS)"
say "up in $(elapsed): partition $PPSPLIT_SLURM_PARTITION, node $NODE, cluster $PPSPLIT_SLURM_CLUSTER, state in $D"
