"""Checkpoints: what a run saves to continue (dcp.py, torch.distributed.checkpoint), how a save becomes visible
only when whole (integrity.py, durable.py), and what a relaunch may change before it resumes (resume.py)."""
