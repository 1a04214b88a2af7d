"""One optimizer step: the rank's share of the model running a batch (model_on_rank.py), the loss (loss.py), the
optimizers and schedule (optimizers.py, muon.py), whether a step may update the weights (step_guard.py), the MoE
routing tally (routing.py), garbage collection between steps, and the seam through which features join the loop
(loop_features.py)."""
