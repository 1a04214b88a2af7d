#!/usr/bin/env bash
# Launch train.py with torchrun on this machine.
#   NGPU         processes on this node (default: the number of CUDA GPUs, or 1 without CUDA)
#   CONFIG_FILE  TOML config (default: train_configs/debug_model.toml); a later
#                --job.config_file on the command line wins
# Every other argument goes to train.py, e.g. ./run_train.sh --training.steps 20
# For several nodes, see docs/multinode.md (torchrun with c10d rendezvous, SLURM example).
set -euo pipefail

if [[ -z "${NGPU:-}" ]]; then
  NGPU=$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")
fi
CONFIG_FILE=${CONFIG_FILE:-train_configs/debug_model.toml}

exec torchrun --standalone --nproc_per_node "$NGPU" "$(dirname "$0")/train.py" --job.config_file "$CONFIG_FILE" "$@"
