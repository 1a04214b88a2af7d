"""Checkpoints: what a run saves to continue (dcp.py, torch.distributed.checkpoint), how a save becomes visible
only when whole (integrity.py, durable.py), a save that finds the disk full (disk_full.py), staging for a writing
process (staging.py), and what a relaunch may change before it resumes (resume.py)."""
