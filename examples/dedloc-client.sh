#!/usr/bin/env bash
# dedloc-client.sh: drive a dedlocd from a shell, with socat and jq only (no Python).
#
#   examples/dedloc-client.sh [SOCKET]
#
# It speaks the daemon's control API, JSON-RPC 2.0 with one JSON message per line on a unix socket
# (docs/rpc-reference.md): it asks node.info who the daemon is, starts a run of the built-in `tiny`
# workload (run.start), follows it with run.status until it has trained a few epochs, printing
# its progress, stops it (run.stop: checkpointed) and prints a one-line JSON summary as its last
# line. An error answer is printed with its message and code, and the script exits non-zero.
#
# SOCKET: the daemon's control socket; default $DEDLOC_SOCKET, else /run/dedlocd/dedlocd.sock
# (the system service) if it exists, else ~/.local/state/dedloc/dedlocd.sock.
# Settings (environment):
#   DEDLOC_RUN           run name (default: shell-example)
#   DEDLOC_EPOCHS        epochs to train before stopping the run (default: 3)
#   DEDLOC_TARGET        the run's target batch size: samples per epoch (default: 2048)
#   DEDLOC_DEVICE        device of the run's worker (default: cpu)
#   DEDLOC_CALL_TIMEOUT  seconds one call may take, starting the worker included (default: 120)
#   DEDLOC_DEADLINE      seconds the epochs may take once the run is started (default: 300)
# Exit codes: 0 done; 1 an error answer, a failed run or the deadline; 2 bad usage or a missing
# tool; 3 the daemon cannot be reached.
# The $names inside single quotes are jq's variables, not the shell's:
# shellcheck disable=SC2016

set -euo pipefail

PROG=dedloc-client
RUN=${DEDLOC_RUN:-shell-example}
EPOCHS=${DEDLOC_EPOCHS:-3}
TARGET=${DEDLOC_TARGET:-2048}
DEVICE=${DEDLOC_DEVICE:-cpu}
CALL_TIMEOUT=${DEDLOC_CALL_TIMEOUT:-120}
DEADLINE=${DEDLOC_DEADLINE:-300}
POLL_SECONDS=0.5
SCHEDULE=1000  # the run's schedule (run.start "epochs"): far more than we train, we stop it first

die() {  # die CODE MESSAGE...
    local code=$1
    shift
    printf '%s: %s\n' "$PROG" "$*" >&2
    exit "$code"
}

for tool in socat jq; do
    command -v "$tool" >/dev/null || die 2 "needs $tool (Debian/Ubuntu: apt-get install socat jq)"
done
for setting in EPOCHS TARGET CALL_TIMEOUT DEADLINE; do
    [[ ${!setting} =~ ^[1-9][0-9]*$ ]] || die 2 "DEDLOC_$setting must be a positive integer, got '${!setting}'"
done
if (($# > 1)); then
    die 2 "usage: $0 [SOCKET]"
fi

SOCKET=${1:-${DEDLOC_SOCKET:-}}
if [[ -z $SOCKET ]]; then
    if [[ -S /run/dedlocd/dedlocd.sock ]]; then
        SOCKET=/run/dedlocd/dedlocd.sock
    else
        SOCKET=$HOME/.local/state/dedloc/dedlocd.sock
    fi
fi
[[ -S $SOCKET ]] || die 3 "no daemon socket at $SOCKET: start dedlocd, or give its socket as the argument or in \$DEDLOC_SOCKET"

REQUEST_ID=0
RESULT=null

# rpc METHOD [PARAMS_JSON]: one JSON-RPC call on a connection of its own; its result goes to
# $RESULT. An error answer is printed (message, code, data) and ends the script.
rpc() {
    local method=$1 params=${2:-null} request response
    REQUEST_ID=$((REQUEST_ID + 1))
    request=$(jq -nc --arg method "$method" --argjson params "$params" --argjson id "$REQUEST_ID" \
        '{jsonrpc: "2.0", id: $id, method: $method} + (if $params == null then {} else {params: $params} end)')
    # socat sends the request, half-closes, and prints the one answer line; the daemon answers and
    # then closes the connection. -T: give up after CALL_TIMEOUT seconds without traffic; -t: wait
    # at most that long for the answer once the request is sent.
    if ! response=$(printf '%s\n' "$request" |
        socat -T "$CALL_TIMEOUT" -t "$CALL_TIMEOUT" - "UNIX-CONNECT:$SOCKET"); then
        die 3 "$method: cannot reach the daemon at $SOCKET"
    fi
    [[ -n $response ]] || die 3 "$method: no answer within ${CALL_TIMEOUT}s (DEDLOC_CALL_TIMEOUT)"
    jq -e 'type == "object"' >/dev/null 2>&1 <<<"$response" ||
        die 1 "$method: the answer is not a JSON-RPC object: $response"
    if jq -e 'has("error")' >/dev/null <<<"$response"; then
        # e.g. "run.start: Invalid params (code -32602): {"param":"name","reason":"..."}"
        die 1 "$(jq -r --arg method "$method" \
            '"\($method): \(.error.message) (code \(.error.code))"
             + (if .error.data == null then "" else ": \(.error.data | tojson)" end)' <<<"$response")"
    fi
    jq -e --argjson id "$REQUEST_ID" '.id == $id and has("result")' >/dev/null <<<"$response" ||
        die 1 "$method: an answer to another request: $response"
    RESULT=$(jq -c '.result' <<<"$response")
}

STARTED=0
stop_on_exit() {  # a run this script started is not left training when the script fails
    if ((STARTED)); then
        STARTED=0
        printf '%s: stopping run %s\n' "$PROG" "$RUN" >&2
        (rpc run.stop "$(jq -nc --arg name "$RUN" '{name: $name}')" >/dev/null) || true
    fi
}
trap stop_on_exit EXIT
trap 'exit 130' INT TERM

# Who is this daemon?
rpc node.info
INFO=$RESULT
jq -r '"daemon \(.peer_id) (dedlocd \(.version)), up \(.uptime_seconds | floor) s, control \(.addresses.control)"' <<<"$INFO"

# Start the run; the answer comes once the worker has loaded the workload. A run of the same name
# and settings that was stopped before resumes from its checkpoint, so count epochs from here.
START_PARAMS=$(jq -nc --arg name "$RUN" --arg device "$DEVICE" --argjson target "$TARGET" \
    --argjson schedule "$SCHEDULE" \
    '{workload: "tiny", name: $name, device: $device, target_batch_size: $target,
      epochs: $schedule, checkpoint_every: 0, config: {batch_size: 16, lr: 0.01}}')
rpc run.start "$START_PARAMS"
STARTED=1
FIRST_EPOCH=$(jq '.epoch' <<<"$RESULT")
jq -r '"started run \(.name): workload \(.workload), target batch \(.target_batch_size), epoch \(.epoch), state \(.state)"' <<<"$RESULT"

# Follow it: one line whenever it has moved on.
NAME_PARAMS=$(jq -nc --arg name "$RUN" '{name: $name}')
WANT=$((FIRST_EPOCH + EPOCHS))
LAST_SHOWN=""
START_TIME=$SECONDS
while :; do
    rpc run.status "$NAME_PARAMS"
    STATUS=$(jq -c '.[0]' <<<"$RESULT")
    LINE=$(jq -r --argjson want "$WANT" '
        def num(digits): if . == null then "-" else (. * pow(10; digits) | round / pow(10; digits) | tostring) end;
        "epoch \(.epoch)/\($want)  samples \(.samples)  accumulated \(.accumulated)/\(.target_batch_size)"
        + "  loss \(.loss | num(4))  \(.samples_per_second | num(1)) samples/s  \(.state)"' <<<"$STATUS")
    if [[ $LINE != "$LAST_SHOWN" ]]; then
        printf '%s\n' "$LINE"
        LAST_SHOWN=$LINE
    fi
    STATE=$(jq -r '.state' <<<"$STATUS")
    EPOCH=$(jq '.epoch' <<<"$STATUS")
    case $STATE in
        crashed | failed)
            die 1 "run $RUN $STATE: $(jq -c '{error, worker: {exit_code: .worker.exit_code, last_log_lines: (.worker.last_log_lines // [])[-5:]}}' <<<"$STATUS")"
            ;;
        stopped | finished)
            STARTED=0
            ((EPOCH >= WANT)) || die 1 "run $RUN was $STATE at epoch $EPOCH, before epoch $WANT"
            break
            ;;
    esac
    if ((EPOCH >= WANT)); then
        break
    fi
    ((SECONDS - START_TIME < DEADLINE)) || die 1 "run $RUN reached epoch $EPOCH of $WANT in ${DEADLINE}s (DEDLOC_DEADLINE)"
    sleep "$POLL_SECONDS"
done

# Stop it (it finishes its current step and checkpoints), then the summary.
rpc run.stop "$NAME_PARAMS"
STARTED=0
FINAL=$RESULT
jq -r '"stopped run \(.name) at epoch \(.epoch): \(.state)"' <<<"$FINAL"
jq -nc --argjson info "$INFO" --argjson run "$FINAL" --argjson first "$FIRST_EPOCH" \
    --argjson seconds "$((SECONDS - START_TIME))" \
    '{peer_id: $info.peer_id, run: $run.name, workload: $run.workload, state: $run.state,
      epochs: ($run.epoch - $first), epoch: $run.epoch, samples: $run.samples,
      loss_first: $run.loss_first, loss: $run.loss, seconds: $seconds}'
