#!/usr/bin/env bash
# ckptd-job.sh: ckptd beside one Slurm job (docs/DEPLOY.md, "2.2 ckptd as a step of the job").
#
# One daemon per node of the job. Its socket, state, PID file and generated config live in a
# node-local directory named after the job (default /tmp/ckptd-$SLURM_JOB_ID): nodes that share
# a file system never share a socket (a Unix socket only works on the node that bound it) or a
# state directory (SQLite in WAL mode wants a local disk), and every node finds its own daemon
# at the same path, so one exported CKPTD_SOCKET serves every rank.
#
#   eval "$(ckptd-job.sh env)"   export CKPTD_SOCKET, CKPTD_CONFIG, CKPTD_JOB_DIR (the trainer's
#                                ckptd.client and ckptd.torch read the first two)
#   ckptd-job.sh run             the daemon in the foreground, as the task of
#                                `srun --overlap --ntasks-per-node=1 ... ckptd-job.sh run &`
#   ckptd-job.sh start           the daemon in the background (no srun), back once it answers;
#                                prints the export lines as `env` does
#   ckptd-job.sh ready           wait until this node's daemon answers
#   ckptd-job.sh drain [ROOT[=STEP]...]
#                                ask for a flush, wait until the newest checkpoint of each
#                                uploading root (or STEP) is uploaded, then stop the daemon
#   ckptd-job.sh stop            stop the daemon: SIGTERM by PID, SIGKILL after --timeout
#
# Options: --timeout SECONDS (start, ready: 120; drain: 240; stop: 60). drain --keep: leave the
# daemon running and use the node's service socket ($CKPTD_SOCKET, else /run/ckptd/ckptd.sock)
# and config ($CKPTD_CONFIG, else /etc/ckptd/ckptd.toml) instead of the job's.
#
# Environment:
#   SLURM_JOB_ID           names the job directory (or set CKPTD_JOB_DIR)
#   CKPTD_JOB_DIR          the node-local job directory (default $CKPTD_JOB_BASE/ckptd-$SLURM_JOB_ID,
#                          CKPTD_JOB_BASE default /tmp); the socket path must stay under 108 bytes
#   CKPTD_JOB_CONFIG       a whole config to use as is (its daemon.socket is replaced by the
#                          job's; its state_dir must be node-local and used by no other daemon)
#   CKPTD_JOB_ROOTS        else: a TOML file of [defaults] and [[roots]] tables (absolute paths,
#                          no [daemon] table), appended to a generated [daemon] table
#   CKPTD_ROOT             else: the one root's directory; with CKPTD_ROOT_NAME (default its
#                          basename), CKPTD_UPLOAD_URL, CKPTD_UPLOAD_ENDPOINT, CKPTD_NODES (default 1),
#                          CKPTD_SETTLE (default: ckptd's, 5s; layouts without a commit record)
#   CKPTD_SCAN_INTERVAL    the generated config's scan_interval (default 5s)
#   CKPTD_NODE             the generated config's daemon.node (default: ckptd uses the hostname)
#   CKPTD_NICE             nice value of the daemon (default 10)
#   CKPTD_BIN              the ckptd command (default: ckptd on PATH)
#   CKPTD_PYTHON           Python 3.11+ to read ckptd's JSON and TOML output (default: the
#                          python3 beside ckptd, else python3 on PATH)
#
# Every value above that becomes a path or a line of the generated config is checked against
# an allow-list first (paths: absolute or relative, of letters, digits, space and
# -._+@%,:=~/, no "." or ".." component; SLURM_JOB_ID, CKPTD_ROOT_NAME, CKPTD_NODE: a letter or
# digit, then up to 63 of letters, digits and ._-; HOSTNAME: a host name; durations, URLs,
# counts and the nice value by their own forms): a value outside it is refused, exit 2.
#
# Exit status: 0 done; 1 drain gave up (a step not uploaded in time, or invalid), or stop
# had to SIGKILL the daemon; 2 usage, or a value from the environment refused; 69 no daemon
# answers (not running, or gone); 75 this job's daemon already runs here; 78 no usable config. The daemon's own exit status is the
# `srun ... run` step's.
set -euo pipefail

PROG=${0##*/}

say() { printf '%s: %s\n' "$PROG" "$*" >&2; }
die() {
    local code=$1
    shift
    say "$*"
    exit "$code"
}
# Deadlines use /proc/uptime, monotonic and in hundredths of a second: bash's SECONDS ticks
# with the wall clock in whole seconds, so a wait on it could end up to a second early.
now() { local u _; read -r u _ </proc/uptime; NOW=$((10#${u/./})); }  # NOW: hundredths
until_after() { now; UNTIL=$((NOW + $1 * 100)); }                      # UNTIL: $1 s from now
past() { now; (( NOW >= $1 )); }                                       # is the time $1 past?

# -- values from the environment ---------------------------------------------------------------
# Each is matched whole against an allow-list, in the C locale (ranges are ASCII only), and
# its length checked apart (a bounded repeat such as {1,1024} costs glibc ~20 ms to compile at
# each match), before it names a file or is written into the config: a crafted job id, host
# name or root never leads a write out of the job's base directory or adds a line to it.
PATH_RE='^[-A-Za-z0-9._+@%,:=~/ ]+$'            # and no "." or ".." component
NAME_RE='^[A-Za-z0-9][A-Za-z0-9._-]*$'          # ckptd's own rule for root names and node ids
HOST_RE='^[A-Za-z0-9_][A-Za-z0-9._-]*$'
DURATION_RE='^[0-9][0-9a-z.]*$'                 # ckptd parses it: "5s", "500ms", "1h30m"
URL_RE='^[a-z][a-z0-9+.-]*://[][A-Za-z0-9._~:/?#@!$&()*+,;=%-]+$'
ENDPOINT_RE='^https?://[][A-Za-z0-9._~:/%-]+$'
COUNT_RE='^[1-9][0-9]*$'
NICE_RE='^-?[0-9]+$'

shown() {  # $1 for a message: quoted as the shell would, control characters escaped, shortened
    local v=$1
    (( ${#v} <= 120 )) || v="${v:0:120}..."
    printf '%q' "$v"
}

allow() {  # $1 the variable's name, $2 its value, $3 the allow-list, $4 its longest, $5... what
    # it must be
    local LC_ALL=C
    [[ ${#2} -le $4 && $2 =~ $3 ]] || die 2 "$1=$(shown "$2") is not ${*:5}: refused"
}

allow_path() {  # $1 the variable's name, $2 the path
    local LC_ALL=C
    allow "$1" "$2" "$PATH_RE" 1024 "a path of letters, digits, space and -._+@%,:=~/"
    [[ /$2/ != */../* && /$2/ != */./* ]] ||
        die 2 "$1=$(shown "$2") has a \".\" or \"..\" component: refused"
}

allow_set() {  # allow "$@" where the variable $1 names is set and not empty
    local value=${!1:-}
    [[ -z $value ]] || allow "$1" "$value" "${@:2}"
}

usage() {
    sed -n '2,/^set -euo pipefail/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//' >&2
    exit 2
}

# -- where things are --------------------------------------------------------------------------

setup() {  # $1: 1 for the node's service (drain --keep), else 0
    CKPTD_BIN=${CKPTD_BIN:-ckptd}
    local bin
    bin=$(command -v "$CKPTD_BIN") || die 69 "no ckptd command: set CKPTD_BIN or put ckptd on PATH"
    if [[ -n ${CKPTD_PYTHON:-} ]]; then
        PY=$CKPTD_PYTHON
    elif [[ -x ${bin%/*}/python3 ]]; then
        PY=${bin%/*}/python3
    else
        PY=python3
    fi
    PID=
    if (( $1 )); then
        SOCKET=${CKPTD_SOCKET:-/run/ckptd/ckptd.sock}
        CONFIG=${CKPTD_CONFIG:-/etc/ckptd/ckptd.toml}
        return
    fi
    allow_set SLURM_JOB_ID "$NAME_RE" 64 "a Slurm job id (a letter or digit, then up to 63 of" \
        "letters, digits and ._-)"
    if [[ -n ${CKPTD_JOB_DIR:-} ]]; then
        allow_path CKPTD_JOB_DIR "$CKPTD_JOB_DIR"
        JOB_DIR=$CKPTD_JOB_DIR
    elif [[ -n ${SLURM_JOB_ID:-} ]]; then
        allow_path CKPTD_JOB_BASE "${CKPTD_JOB_BASE:-/tmp}"
        JOB_DIR=${CKPTD_JOB_BASE:-/tmp}/ckptd-$SLURM_JOB_ID
    else
        die 2 "SLURM_JOB_ID is not set: run inside a Slurm job, or set CKPTD_JOB_DIR"
    fi
    [[ $JOB_DIR == /* ]] || JOB_DIR=$PWD/$JOB_DIR
    allow_path "the job directory" "$JOB_DIR"  # the working directory joined to a relative one
    [[ -z ${CKPTD_JOB_CONFIG:-} ]] || allow_path CKPTD_JOB_CONFIG "$CKPTD_JOB_CONFIG"
    SOCKET=$JOB_DIR/ckptd.sock
    PIDFILE=$JOB_DIR/ckptd.pid
    CONFIG=${CKPTD_JOB_CONFIG:-$JOB_DIR/ckptd.toml}
    (( ${#SOCKET} < 108 )) || die 2 "socket path $SOCKET is ${#SOCKET} bytes, over the 107 a" \
        "Unix socket allows: set a shorter CKPTD_JOB_DIR"
}

make_job_dir() {  # node-local and ours: /tmp is shared by every user of the node
    if [[ ! -e $JOB_DIR ]]; then
        mkdir -p -- "${JOB_DIR%/*}"
        mkdir -m 0700 -- "$JOB_DIR" 2>/dev/null || true  # another step of the job may race us
    fi
    [[ -d $JOB_DIR && ! -L $JOB_DIR && -O $JOB_DIR ]] ||
        die 78 "$JOB_DIR is not a directory of $(id -un): refusing to use it"
}

# -- the config --------------------------------------------------------------------------------

toml() {  # $1 as a TOML basic string, in REPLY: backslash and quote escaped, no control char
    local s=$1 LC_ALL=C
    [[ $s != *[[:cntrl:]]* ]] || die 2 "a control character in config value $(shown "$s")"
    s=${s//\\/\\\\}
    REPLY="\"${s//\"/\\\"}\""
}

check_config_env() {  # every value write_config puts into the config, before anything is written;
    # sets ROOT_DIR and ROOT_NAME of the one root CKPTD_ROOT names
    allow_set CKPTD_NICE "$NICE_RE" 3 "a nice value (-20 to 19)"
    [[ -z ${CKPTD_JOB_CONFIG:-} ]] || return 0  # given: used as is
    allow HOSTNAME "$HOSTNAME" "$HOST_RE" 253 "a host name"
    allow_set CKPTD_NODE "$NAME_RE" 64 "a node id (a letter or digit, then up to 63 of letters," \
        "digits and ._-)"
    allow_set CKPTD_SCAN_INTERVAL "$DURATION_RE" 32 "a duration such as 5s"
    if [[ -n ${CKPTD_JOB_ROOTS:-} ]]; then
        allow_path CKPTD_JOB_ROOTS "$CKPTD_JOB_ROOTS"
        return
    fi
    allow_set CKPTD_ROOT_NAME "$NAME_RE" 64 "a root name (a letter or digit, then up to 63 of" \
        "letters, digits and ._-)"
    allow_set CKPTD_NODES "$COUNT_RE" 6 "a count of nodes (1 to 999999)"
    allow_set CKPTD_SETTLE "$DURATION_RE" 32 "a duration such as 5s"
    allow_set CKPTD_UPLOAD_URL "$URL_RE" 2048 "a URL such as s3://bucket/prefix"
    allow_set CKPTD_UPLOAD_ENDPOINT "$ENDPOINT_RE" 1024 "an http(s) URL"
    [[ -n ${CKPTD_ROOT:-} ]] || die 78 "no roots: set CKPTD_ROOT (the checkpoint" \
        "directory), CKPTD_JOB_ROOTS or CKPTD_JOB_CONFIG"
    allow_path CKPTD_ROOT "$CKPTD_ROOT"
    ROOT_DIR=$CKPTD_ROOT
    [[ $ROOT_DIR == /* ]] || ROOT_DIR=$PWD/$ROOT_DIR
    while [[ $ROOT_DIR == ?*/ ]]; do ROOT_DIR=${ROOT_DIR%/}; done
    allow_path "the root's directory" "$ROOT_DIR"  # the working directory joined to it
    ROOT_NAME=${CKPTD_ROOT_NAME:-${ROOT_DIR##*/}}
    allow "the root's name (CKPTD_ROOT_NAME, else the directory's name)" "$ROOT_NAME" \
        "$NAME_RE" 64 "a root name (a letter or digit, then up to 63 of letters, digits and ._-)"
}

write_config() {  # after check_config_env
    [[ -z ${CKPTD_JOB_CONFIG:-} ]] || return 0  # given: used as is
    local tmp=$CONFIG.tmp.$$
    {
        printf '# Written by %s for Slurm job %s on %s at each start.\n' \
            "$PROG" "${SLURM_JOB_ID:-?}" "$HOSTNAME"
        printf '[daemon]\n'
        toml "$JOB_DIR/state"; printf 'state_dir = %s\n' "$REPLY"
        toml "$SOCKET"; printf 'socket = %s\n' "$REPLY"
        toml "${CKPTD_SCAN_INTERVAL:-5s}"; printf 'scan_interval = %s\n' "$REPLY"
        printf 'log_format = "json"\n'
        if [[ -n ${CKPTD_NODE:-} ]]; then toml "$CKPTD_NODE"; printf 'node = %s\n' "$REPLY"; fi
        printf '\n'
        if [[ -n ${CKPTD_JOB_ROOTS:-} ]]; then
            [[ -f $CKPTD_JOB_ROOTS && -r $CKPTD_JOB_ROOTS ]] ||
                die 78 "CKPTD_JOB_ROOTS=$CKPTD_JOB_ROOTS is not a readable file"
            printf '# %s\n' "$CKPTD_JOB_ROOTS"
            cat -- "$CKPTD_JOB_ROOTS"
        else
            printf '[[roots]]\n'
            toml "$ROOT_NAME"; printf 'name = %s\n' "$REPLY"
            toml "$ROOT_DIR"; printf 'path = %s\n' "$REPLY"
            printf 'nodes = %s\n' "${CKPTD_NODES:-1}"
            if [[ -n ${CKPTD_SETTLE:-} ]]; then
                toml "$CKPTD_SETTLE"; printf 'settle = %s\n' "$REPLY"
            fi
            if [[ -n ${CKPTD_UPLOAD_URL:-} ]]; then
                toml "$CKPTD_UPLOAD_URL"; printf 'upload.url = %s\n' "$REPLY"
            fi
            if [[ -n ${CKPTD_UPLOAD_ENDPOINT:-} ]]; then
                toml "$CKPTD_UPLOAD_ENDPOINT"; printf 'upload.endpoint = %s\n' "$REPLY"
            fi
        fi
    } >"$tmp"
    mv -f -- "$tmp" "$CONFIG"
    if [[ -n ${CKPTD_ROOT:-} && -z ${CKPTD_JOB_ROOTS:-} ]]; then
        mkdir -p -- "$ROOT_DIR"  # the trainer may not have made it yet; ckptd watches it from the start
    fi
}

# -- the daemon's process ----------------------------------------------------------------------

alive() {  # PID $1 exists and is not a zombie (an exited child not yet reaped)
    local stat state
    stat=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    state=${stat##*) }
    state=${state%% *}
    [[ $state != [ZX] ]]
}

is_ckptd() {  # PID $1 lives and runs `ckptd ... run`: never signal a PID reused by another
    local cmd
    alive "$1" || return 1
    cmd=$(tr '\0' ' ' <"/proc/$1/cmdline" 2>/dev/null) || return 1
    [[ $cmd == *ckptd* && $cmd == *" run "* ]]
}

daemon_pid() {  # the job's daemon on this node, in PID; false when none runs
    local p=
    PID=
    [[ -r $PIDFILE ]] || return 1
    read -r p <"$PIDFILE" || true
    [[ $p =~ ^[0-9]+$ ]] && is_ckptd "$p" || return 1
    PID=$p
}

answers() { "$CKPTD_BIN" status --json --socket "$SOCKET" >/dev/null 2>&1; }

wait_ready() {  # $1: seconds; $2: the daemon's PID when we started it (fail at once if it dies)
    local end rc
    until_after "$1"
    end=$UNTIL
    until answers; do
        if [[ -n ${2:-} ]] && ! alive "$2"; then
            wait "$2" && rc=0 || rc=$?
            die 69 "ckptd exited (status $rc) before it answered; its log: $JOB_DIR/ckptd.log"
        fi
        ! past "$end" || die 69 "ckptd did not answer at $SOCKET within $1 s" \
            "($(daemon_pid && echo "pid $PID runs" || echo "no ckptd of this job runs here"))"
        sleep 0.2
    done
}

export_lines() {
    printf 'export CKPTD_JOB_DIR=%q\n' "$JOB_DIR"
    printf 'export CKPTD_SOCKET=%q\n' "$SOCKET"
    printf 'export CKPTD_CONFIG=%q\n' "$CONFIG"
}

stop_daemon() {  # $1: seconds after SIGTERM before SIGKILL
    local end
    [[ -n $PID ]] || return 0
    until_after "$1"
    end=$UNTIL
    say "stopping ckptd (pid $PID)"
    kill -TERM "$PID" 2>/dev/null || return 0
    while is_ckptd "$PID"; do
        if past "$end"; then
            say "ckptd (pid $PID) still runs $1 s after SIGTERM: SIGKILL (unfinished work" \
                "resumes at its next start on this root)"
            kill -KILL "$PID" 2>/dev/null || true
            return 1
        fi
        sleep 0.2
    done
    rm -f -- "$PIDFILE"
    say "ckptd (pid $PID) stopped"
}

# -- reading ckptd's answers -------------------------------------------------------------------

# Each mode reads one JSON (or TOML) document on stdin and prints tab-separated fields.
# shellcheck disable=SC2016 # Python, not shell
PYREAD='
import json, sys, tomllib
mode, args = sys.argv[1], sys.argv[2:]
text = sys.stdin.read()
if mode == "uploading":  # `ckptd config check`: the roots with an upload.url
    for r in tomllib.loads(text).get("roots", []):
        if r.get("upload", {}).get("url"):
            print(r["name"])
elif mode == "scans":
    print(json.loads(text)["scans"])
elif mode == "root":  # status: acting, holder node, last error
    for r in json.loads(text)["roots"]:
        if r["name"] == args[0]:
            holder = (r.get("holder") or {}).get("node") or "another daemon"
            err = " ".join(str(r.get("last_error") or "").split())[:300]
            print("yes" if r.get("acting", True) else "no", holder, err, sep="\t")
            break
elif mode == "newest":  # ls: the newest checkpoint neither invalid nor gone
    for c in reversed(json.loads(text)["checkpoints"]):
        if c["state"] != "invalid" and (c["local"] != "pruned" or c["remote"] == "uploaded"):
            print(c["step"], c["state"], c["remote"], sep="\t")
            break
elif mode == "step":  # ls: state, remote, reason of one step
    for c in json.loads(text)["checkpoints"]:
        if c["step"] == int(args[0]):
            print(c["state"], c["remote"], " ".join(str(c.get("reason") or "-").split()), sep="\t")
            break
elif mode == "latest":  # latest --json: step, remote
    doc = json.loads(text)
    print(doc.get("step"), doc.get("remote"), sep="\t")
'
read_doc() { "$PY" -c "$PYREAD" "$@"; }

ck() { "$CKPTD_BIN" "$@" --socket "$SOCKET"; }

scans() { ck status --json | read_doc scans; }

root_field() {  # $1 root, $2 mode of PYREAD (with $3): one line, empty when not found
    ck ls "$1" --json 2>/dev/null | read_doc "$2" "${3:-}" || true
}

# -- drain -------------------------------------------------------------------------------------

flush() {  # the newest valid step of each uploading root goes before other copies and uploads
    ck flush --no-wait >/dev/null 2>&1 && return
    if [[ -n $PID ]]; then
        kill -USR1 "$PID" 2>/dev/null || true  # what `ckptd flush` asks for, by signal
    else
        say "could not ask $SOCKET for a flush; waiting all the same"
    fi
}

wait_scans() {  # two more full scans: whatever was on disk before now is known to the daemon
    local s0 n
    s0=$(scans) || die 69 "ckptd at $SOCKET does not answer"
    while n=$(scans) && (( n < s0 + 2 )); do
        ! past "$DEADLINE" || return 0
        sleep 0.2
    done
}

wait_published() {  # $1 root, $2 step or "", $3 holder: another daemon acts on the root
    local s r out
    say "$1: $3 acts on this root; waiting until the latest step it publishes${2:+ (step $2" \
        "or later)} is uploaded"
    while :; do
        out=$(ck latest "$1" --json 2>/dev/null | read_doc latest) || out=
        IFS=$'\t' read -r s r <<<"$out" || true
        if [[ $r == uploaded && $s =~ ^[0-9]+$ ]] && { [[ -z $2 ]] || (( s >= $2 )); }; then
            say "$1 step $s: uploaded (by $3)"
            return 0
        fi
        if past "$DEADLINE"; then
            say "$1: the latest step $3 publishes${s:+ ($s, remote ${r:-none})} is not" \
                "uploaded after $TIMEOUT s: giving up"
            return 1
        fi
        sleep 1
    done
}

wait_step() {  # $1 root, $2 step, $3 valid|uploaded, until the deadline; WAIT_RC: ckptd's
    local left
    WAIT_RC=1
    now
    left=$((DEADLINE - NOW))
    (( left > 0 )) || return 1
    ck wait "$1" "$2" --until "$3" --timeout "$((left / 100)).$((left % 100 / 10))$((left % 10))" \
        >/dev/null && WAIT_RC=0 || WAIT_RC=$?
    return "$WAIT_RC"
}

drain_root() {  # $1: ROOT or ROOT=STEP
    local name=${1%%=*} step='' info acting holder err target state remote reason
    [[ $1 != *=* ]] || step=${1#*=}
    info=$(ck status --json | read_doc root "$name") || die 69 "ckptd at $SOCKET does not answer"
    if [[ -z $info ]]; then
        say "$name: not a root of the ckptd at $SOCKET"
        return 1
    fi
    IFS=$'\t' read -r acting holder err <<<"$info" || true
    if [[ $acting == no ]]; then
        wait_published "$name" "$step" "$holder"
        return
    fi
    while :; do
        target=$step state=missing remote=none reason=-
        if [[ -z $target ]]; then
            info=$(root_field "$name" newest)
            if [[ -z $info ]]; then
                say "$name: no checkpoint, nothing to upload"
                return 0
            fi
            IFS=$'\t' read -r target state remote <<<"$info" || true
        else
            info=$(root_field "$name" step "$target")
            [[ -z $info ]] || IFS=$'\t' read -r state remote reason <<<"$info" || true
        fi
        if [[ $remote == uploaded ]]; then
            say "$name step $target: uploaded"
            return 0
        fi
        if wait_step "$name" "$target" valid; then
            flush  # now that it is valid, it goes before every other copy and upload
            if wait_step "$name" "$target" uploaded; then
                say "$name step $target: uploaded"
                return 0
            fi
        fi
        (( WAIT_RC != 69 )) || { say "ckptd at $SOCKET stopped answering"; return 1; }
        info=$(root_field "$name" step "$target")
        [[ -z $info ]] || IFS=$'\t' read -r state remote reason <<<"$info" || true
        if [[ $state == invalid ]]; then
            if [[ -n $step ]]; then
                say "$name step $target is invalid ($reason): it is not uploaded"
                return 1
            fi
            say "$name step $target is invalid ($reason): waiting for the one before it"
            continue
        fi
        if past "$DEADLINE"; then
            info=$(ck status --json 2>/dev/null | read_doc root "$name") || info=
            IFS=$'\t' read -r acting holder err <<<"$info" || true
            say "$name step $target is not uploaded after $TIMEOUT s (state $state, remote" \
                "$remote${err:+; last error: $err}): giving up"
            return 1
        fi
        sleep 0.5
    done
}

cmd_drain() {
    local keep=0 rc=0 specs=() roots=() out spec explicit=1
    TIMEOUT=240
    while (( $# )); do
        case $1 in
            --timeout) TIMEOUT=${2:?--timeout needs seconds}; shift 2 ;;
            --timeout=*) TIMEOUT=${1#*=}; shift ;;
            --keep) keep=1; shift ;;
            -h|--help) usage ;;
            -*) die 2 "drain: unknown option $1" ;;
            *) specs+=("$1"); shift ;;
        esac
    done
    [[ $TIMEOUT =~ ^[0-9]{1,9}$ ]] || die 2 "--timeout must be whole seconds (up to 9 digits), got $TIMEOUT"
    for spec in ${specs[@]+"${specs[@]}"}; do  # bash before 4.4: an empty array is unset
        [[ $spec =~ ^[^=]+(=[0-9]+)?$ ]] || die 2 "drain: $spec is not ROOT or ROOT=STEP"
        [[ $spec == *=* ]] || explicit=0
    done
    setup "$keep"
    until_after "$TIMEOUT"
    DEADLINE=$UNTIL
    if (( ! keep )); then
        daemon_pid || die 69 "no ckptd of this job runs on $HOSTNAME (PID file $PIDFILE)"
    fi
    flush
    if (( ${#specs[@]} )); then
        roots=("${specs[@]}")
    else
        out=$("$CKPTD_BIN" config check "$CONFIG" | read_doc uploading) ||
            die 78 "cannot read the roots of $CONFIG"
        [[ -z $out ]] || mapfile -t roots <<<"$out"
        explicit=0
    fi
    if (( ${#roots[@]} == 0 )); then
        say "no root of $CONFIG uploads: nothing to drain"
    else
        (( explicit )) || wait_scans
        for spec in "${roots[@]}"; do
            drain_root "$spec" || rc=1
        done
    fi
    (( keep )) || stop_daemon 60 || true
    exit "$rc"
}

# -- the other modes ---------------------------------------------------------------------------

timeout_opt() {  # parse [--timeout S] into TIMEOUT (default $1); nothing else is taken
    TIMEOUT=$1
    shift
    case ${1:-} in
        --timeout) TIMEOUT=${2:?--timeout needs seconds}; (( $# == 2 )) || usage ;;
        --timeout=*) TIMEOUT=${1#*=}; (( $# == 1 )) || usage ;;
        '') ;;
        *) usage ;;
    esac
    [[ $TIMEOUT =~ ^[0-9]{1,9}$ ]] || die 2 "--timeout must be whole seconds (up to 9 digits), got $TIMEOUT"
}

cmd_run() {
    (( $# == 0 )) || usage
    setup 0
    check_config_env
    make_job_dir
    ! daemon_pid || die 75 "a ckptd of this job already runs here (pid $PID)"
    write_config
    printf '%s\n' "$$" >"$PIDFILE"  # exec keeps the PID
    exec nice -n "${CKPTD_NICE:-10}" "$CKPTD_BIN" run --config "$CONFIG" --socket "$SOCKET"
}

cmd_start() {
    timeout_opt 120 "$@"
    setup 0
    check_config_env
    make_job_dir
    ! daemon_pid || die 75 "a ckptd of this job already runs here (pid $PID)"
    write_config
    nohup nice -n "${CKPTD_NICE:-10}" "$CKPTD_BIN" run --config "$CONFIG" --socket "$SOCKET" \
        >>"$JOB_DIR/ckptd.log" 2>&1 </dev/null &
    printf '%s\n' "$!" >"$PIDFILE"
    wait_ready "$TIMEOUT" "$!"
    export_lines
}

main() {
    local mode=${1:-}
    (( $# )) && shift
    case $mode in
        env) (( $# == 0 )) || usage; setup 0; export_lines ;;
        run) cmd_run "$@" ;;
        start) cmd_start "$@" ;;
        ready) timeout_opt 120 "$@"; setup 0; wait_ready "$TIMEOUT" ;;
        drain) cmd_drain "$@" ;;
        stop)
            timeout_opt 60 "$@"
            setup 0
            daemon_pid || { say "no ckptd of this job runs on $HOSTNAME"; exit 0; }
            stop_daemon "$TIMEOUT"
            ;;
        -h|--help|help) usage ;;
        *) usage ;;
    esac
}

main "$@"
