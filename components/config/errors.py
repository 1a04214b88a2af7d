"""The error of a setting that cannot be used: train.py turns it into one line and exit status 2. Here, apart from
components/config/, so that what the config loader itself imports (models/families.py) can raise it
without importing the loader back."""


class ConfigError(ValueError):
    """A config file or command-line override that cannot be used; the message says why."""
