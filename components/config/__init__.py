"""The configuration: a TOML file under train_configs/, then `--section.key value` overrides.

Every field of schema.py (and of the model family's config.py, for `[model]`) can be set in the file or on
the command line. Unknown keys and values of the wrong type or out of range stop the run at start-up with a
message that names the key (and the nearest valid one). schema.py holds the sections, loading.py reads and
writes configs; scripts/config.py generates docs/configuration.md.
"""

from components.config.errors import ConfigError
from components.config.loading import (
    all_keys,
    all_ranges,
    dump_config,
    git_commit,
    load_config,
    read_key,
    resolve_config_file,
    to_toml,
)
from components.config.schema import (
    CHOICES,
    CONFIG_DIR,
    COUNT,
    DECAY,
    DTYPES,
    FRACTION,
    NON_NEGATIVE,
    OFF_AT_0,
    POSITIVE,
    RANGES,
    REPO_ROOT,
    SECTIONS,
    ActivationCheckpoint,
    Checkpoint,
    Comm,
    Compile,
    Config,
    Evaluation,
    FaultTolerance,
    Float8,
    Job,
    LRScheduler,
    Metrics,
    Model,
    MoE,
    Optimizer,
    Parallelism,
    Profiling,
    Range,
    Training,
    Validation,
    field_types,
)

__all__ = [
    "CHOICES", "CONFIG_DIR", "COUNT", "DECAY", "DTYPES", "FRACTION", "NON_NEGATIVE", "OFF_AT_0", "POSITIVE", "RANGES",
    "REPO_ROOT", "SECTIONS", "ActivationCheckpoint", "Checkpoint", "Comm", "Compile", "Config", "ConfigError",
    "Evaluation", "FaultTolerance", "Float8", "Job", "LRScheduler", "Metrics", "Model", "MoE", "Optimizer",
    "Parallelism", "Profiling", "Range", "Training", "Validation", "all_keys", "all_ranges", "dump_config",
    "field_types", "git_commit", "load_config", "read_key", "resolve_config_file",
    "to_toml",
]
