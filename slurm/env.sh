# Environment for syncrl job steps, sourced by the sbatch scripts. Every value can be overridden by
# exporting it before sbatch (sbatch passes the submitting environment on); what this file sets is
# logged, so a job's log says which defaults it ran with.

_syncrl_default() {  # name value: set unless the user already did
    if [ -z "${!1+x}" ]; then
        export "$1=$2"
        echo "syncrl env: $1=$2 (default)"
    else
        echo "syncrl env: $1=${!1} (from your environment)"
    fi
}

# A rank that dies must fail the others' collectives with an error instead of hanging them.
_syncrl_default TORCH_NCCL_ASYNC_ERROR_HANDLING 3
# One OpenMP thread per rank: ranks share the node's cores; torch sets its own pools where needed.
_syncrl_default OMP_NUM_THREADS 1
# Tokenizers' own thread pool deadlocks in forked workers and competes with the ranks for cores.
_syncrl_default TOKENIZERS_PARALLELISM false
# Python prints through at once, so `syncrl tail -f` shows lines as they happen.
_syncrl_default PYTHONUNBUFFERED 1
# On CPU-only nodes (and the local test cluster) DeepSpeed picks its CPU accelerator; say so quietly.
if ! command -v nvidia-smi >/dev/null 2>&1; then
    _syncrl_default DS_ACCELERATOR cpu
fi
unset -f _syncrl_default
