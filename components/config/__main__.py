"""`python -m components.config --markdown`: the configuration reference; with overrides instead, the resolved
config as TOML (`python -m components.config --job.config_file llama3_8b.toml --training.steps 10`)."""

import sys

from components.config import ConfigError, load_config, to_toml
from components.config.reference import markdown_reference

if sys.argv[1:] == ["--markdown"]:
    print(markdown_reference(), end="")
else:
    try:
        print(to_toml(load_config()), end="")
    except ConfigError as e:
        sys.exit(f"config error: {e}")
