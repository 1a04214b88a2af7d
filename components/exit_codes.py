"""The exit statuses a training run chooses (docs/reliability.md; components/stopping.py maps what ended a run to
them). Nothing imported here, so that the launcher (components/launch.py) reads them without importing torch's
checkpointing."""

EXIT_BAD_INPUT, EXIT_STOPPED, EXIT_HUNG = 2, 3, 4
"""A config or input that cannot be used; a run stopped by its step guard (non-finite values, too many skipped
steps); a run whose collective timed out because a rank stopped making progress (components/heartbeat.py)."""
EXIT_PREEMPTED = 75
"""Exit status of a run stopped by a signal after saving its checkpoint (EX_TEMPFAIL of sysexits.h:
"try again later")."""
