#!/usr/bin/env bash
# Run a command for at most LIMIT_S seconds, then end it and every process it started:
#   bench/run_group.sh LIMIT_S COMMAND [ARG...]
# `timeout` signals only the command itself; pytest-xdist's workers outlive their
# controller, so a GPU test run cut at its limit kept using the GPU under the benchmark that
# followed it in the same device call (run 31c's 8B prefill: 293 ms against 128 alone). The
# command runs in a session of its own; at the limit, and again when it ends, the whole
# session's process group gets SIGTERM, then SIGKILL 5 s later. Exit status: the command's,
# or 124 when the limit cut it (as timeout's).
set -u
LIMIT_S=${1:?usage: bench/run_group.sh LIMIT_S COMMAND [ARG...]}
shift
[ $# -gt 0 ] || { echo "usage: bench/run_group.sh LIMIT_S COMMAND [ARG...]" >&2; exit 2; }
setsid "$@" &
pid=$!
cut_flag=$(mktemp)
# The watchdog takes its sleep with it when it is ended, and writes nowhere: a sleep left
# behind would hold the caller's pipe open, so `$(run_group.sh ...)` waited out LIMIT_S.
( trap 'kill "$nap" 2>/dev/null; exit 0' TERM
  sleep "$LIMIT_S" & nap=$!; wait "$nap"
  echo cut > "$cut_flag"; kill -TERM -- -"$pid" 2>/dev/null
  sleep 5 & nap=$!; wait "$nap"; kill -KILL -- -"$pid" 2>/dev/null ) >/dev/null 2>&1 &
watchdog=$!
wait "$pid"
rc=$?
kill "$watchdog" 2>/dev/null
wait "$watchdog" 2>/dev/null
# Whatever the command left running (its workers) goes with it.
if kill -0 -- -"$pid" 2>/dev/null; then
  kill -TERM -- -"$pid" 2>/dev/null; sleep 1; kill -KILL -- -"$pid" 2>/dev/null
fi
[ -s "$cut_flag" ] && rc=124
rm -f "$cut_flag"
exit "$rc"
