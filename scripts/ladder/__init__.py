"""Scaling-law ladders: train a few model sizes at a few token budgets, fit L(N, D) to their final
losses and predict a larger run; `python -m scripts.ladder --help`, docs/scaling.md."""
