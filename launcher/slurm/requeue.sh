# Sourced by the Slurm templates (from the repository root): restarts, preemption and requeueing.
#
#   run_with_requeue srun ... torchrun ... launcher/main.py conf/X.yaml trainer.resume=auto ...
#
# - torchrun --max-restarts restarts the workers after a rank dies; TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
#   gives each attempt its own rendezvous store (launcher/dist.py also namespaces it per attempt).
# - `#SBATCH --signal=B:USR1@300` makes Slurm send USR1 to this script 300 s before the time limit;
#   SIGTERM comes with scancel or preemption. Either touches HYBRIDRL_STOP_FILE: every worker's
#   watchdog sees it, the step finishes, a checkpoint is saved, the workers exit 75 (torchrun's
#   agent would SIGKILL its workers 30 s after forwarding a signal, so the file, not a signal, is
#   the request). After USR1 the job is requeued (scontrol requeue) and resumes with
#   trainer.resume=auto. After SIGTERM it is not by default: scancel means stop, and Slurm requeues
#   a preempted job itself when the partition's PreemptMode is REQUEUE. Where preemption cancels
#   (PreemptMode=CANCEL with a GraceTime), export HYBRIDRL_REQUEUE_ON="USR1 TERM" to requeue then too.
# - HYBRIDRL_REQUEUE_ON="" turns requeueing off.

export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1
export HYBRIDRL_STOP_FILE="${HYBRIDRL_STOP_FILE:-${PWD}/logs/slurm/stop-${SLURM_JOB_ID:-local}}"
mkdir -p "$(dirname "${HYBRIDRL_STOP_FILE}")"
rm -f "${HYBRIDRL_STOP_FILE}"  # a requeued job starts without the old request

_hybridrl_signal=""
_hybridrl_on_signal() {
  _hybridrl_signal="$1"
  touch "${HYBRIDRL_STOP_FILE}"
  echo "job ${SLURM_JOB_ID:-?}: ${1}: asked the run to checkpoint and stop (${HYBRIDRL_STOP_FILE})" >&2
}

run_with_requeue() {
  trap '_hybridrl_on_signal USR1' USR1
  trap '_hybridrl_on_signal TERM' TERM
  "$@" &
  local pid=$! rc
  # a trapped signal interrupts `wait` (status > 128) while the command runs on: wait again
  while :; do
    rc=0
    wait "${pid}" || rc=$?
    kill -0 "${pid}" 2>/dev/null || break
  done
  trap - USR1 TERM
  if [ -n "${_hybridrl_signal}" ] && [[ " ${HYBRIDRL_REQUEUE_ON-USR1} " == *" ${_hybridrl_signal} "* ]]; then
    echo "job ${SLURM_JOB_ID}: requeueing (run exit ${rc}); it continues with trainer.resume=auto" >&2
    scontrol requeue "${SLURM_JOB_ID}"
    return 0
  fi
  return "${rc}"
}
