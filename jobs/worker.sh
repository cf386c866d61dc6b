#!/bin/bash
# pearlctl worker wrapper: runs one node's worker payload inside a Slurm array task (or a local
# process group) and turns Slurm's preemption notice into a drain.
#
#   worker.sh [COMMAND ARGS...]     default command: $PEARL_PYTHON -m pearlctl.agent
#
# The payload runs as a child; the signals Slurm sends to the batch shell are forwarded to it:
#   $PEARL_PREEMPT_SIGNAL (default USR2; sent ahead of preemption/time limit by --signal=B:SIG@T),
#   TERM (end of GraceTime, scancel), INT. The wrapper exits with the payload's status.
# It never uses USR1: NCCL may claim it.
set -u
sig="${PEARL_PREEMPT_SIGNAL:-USR2}"
if [ $# -eq 0 ]; then
  set -- "${PEARL_PYTHON:-python3}" -m pearlctl.agent
fi
task="${SLURM_ARRAY_JOB_ID:-${SLURM_JOB_ID:-${PEARL_LOCAL_JOB_ID:-none}}}_${SLURM_ARRAY_TASK_ID:-${PEARL_LOCAL_TASK_ID:-0}}"
echo "pearl-worker $(date +%s.%N) start task=$task node=${SLURMD_NODENAME:-$(hostname)} gpus=${CUDA_VISIBLE_DEVICES:-none} restart=${SLURM_RESTART_COUNT:-0} cmd=$*" >&2

# The payload starts with the notice ignored, until it installs its own handler (pearlctl.agent does so before
# anything else): a notice in its first moments would otherwise kill it (status 128 + the signal's number), and
# Slurm would end the task as failed instead of requeueing it when the grace time ends. A notice the payload
# ignored is followed by TERM at the end of the grace time, which it handles.
trap '' "$sig"
"$@" &
child=$!
trapped=0
forward() {
  trapped=1
  echo "pearl-worker $(date +%s.%N) got $1, forwarding to $child" >&2
  kill "-$1" "$child" 2>/dev/null
}
trap 'forward "$sig"' "$sig"
trap "forward TERM" TERM
trap "forward INT" INT

while :; do
  trapped=0
  wait "$child"
  rc=$?
  # A trapped signal cuts `wait` short (status > 128) while the payload may still run: wait again.
  # (Probing with `kill -0` here loses the payload's status when it exits in between.)
  [ "$trapped" = 1 ] || break
done
echo "pearl-worker $(date +%s.%N) payload exited rc=$rc" >&2
exit "$rc"
