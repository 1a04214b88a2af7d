"""Downstream evaluation in the training loop: multiple-choice tasks scored by log-likelihood."""
