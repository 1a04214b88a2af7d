#!/usr/bin/env bash
# Launch train.py with torchrun on this machine, through components/run/launch.py: it exits with the workers' own
# status (0; 2 bad config or input; 3 stopped by the step guard; 4 a hang; 75 preempted after a checkpoint; the worst one
# when ranks differ; see docs/reliability.md) and shows a failure once, from the rank that failed first.
#   NGPU         processes on this node (default: the number of CUDA GPUs, or 1 without CUDA)
#   OMP_NUM_THREADS  CPU threads of each process (default with NGPU > 1: 1, torchrun's choice)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml); a later
#                --job.config_file on the command line wins
# Every other argument goes to train.py, e.g. ./run_train.sh --training.steps 20
# For several nodes, see docs/multinode.md (torchrun with c10d rendezvous, SLURM example).
set -euo pipefail

CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}
# On SIGTERM or SIGUSR1 (SLURM's warnings before a kill), torchrun passes the signal to the workers,
# which save a checkpoint and exit with status 75; torchrun gives them TORCH_ELASTIC_SHUTDOWN_TIMEOUT
# seconds before it kills them. See docs/reliability.md.
export PET_SIGNALS_TO_HANDLE=${PET_SIGNALS_TO_HANDLE:-SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1}
export TORCH_ELASTIC_SHUTDOWN_TIMEOUT=${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-300}

ROOT=$(dirname "$0")
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
# Without NGPU the launcher starts one process per CUDA GPU, or one (components/run/launch.py).
exec python -m components.run.launch --standalone ${NGPU:+--nproc_per_node "$NGPU"} "$ROOT/train.py" \
  --job.config_file "$CONFIG_FILE" "$@"
