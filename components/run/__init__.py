"""A run's life outside the step: the launcher (launch.py), one job per dump folder (lock.py), the scheduler's stop
signals (stop_signals.py), how a run ends and with which exit status (stopping.py, exit_codes.py), and the
heartbeat that names ranks that hang (heartbeat.py)."""
