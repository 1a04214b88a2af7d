"""The scheduler's stop signals, held from a process's launch until the trainer can act on them.

SIGTERM and SIGUSR1 (SLURM's warning before a kill, a plain `kill`, Kubernetes) may come at any moment, start-up
included: while Python imports torch, while the processes rendezvous, while a checkpoint loads. Their default action
ends a process at once, before anything is saved. So the launcher blocks them first thing (a blocked signal stays
pending, neither lost nor acted on), its workers inherit the blocked mask when torchrun starts them, and each side
unblocks them only once its own handler is in place: the launcher once torchrun's forwarding handler is installed and
the workers started, a worker once train.main's StopSignals notes them. Nothing of torch is imported here: the
launcher holds the signals before importing it.
"""

from __future__ import annotations

import signal

STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGUSR1})


def hold_stop_signals() -> set[int]:
    """Block the stop signals for this thread and the processes it starts from now on. Returns the mask before."""
    return signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)


def release_stop_signals() -> set[int]:
    """Unblock the stop signals: one that came while they were held reaches its handler now. Returns the mask before."""
    return signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)


def stop_signal_pending() -> bool:
    """Whether a stop signal came while held and waits, blocked, for its handler."""
    return bool(signal.sigpending() & STOP_SIGNALS)
