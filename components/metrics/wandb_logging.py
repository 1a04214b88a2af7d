"""Weights & Biases logging (metrics.enable_wandb, docs/wandb.md). wandb is an optional extra, imported only
here: a run that asks for it without it installed stops at start-up (check_installed), before it writes anything.

Rank 0 logs to one W&B run, with its files under <dump_folder>/wandb/. A launch that resumes a checkpoint
continues the run of the launch before it, whose id <dump_folder>/wandb_run_id keeps; a launch from step 1
(the first, or a fresh start) begins a new run."""

from __future__ import annotations

import sys
from pathlib import Path

from components.config import ConfigError, Metrics, git_commit

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

INSTALL = "pip install -e '.[wandb]'"
RUN_ID_FILE = "wandb_run_id"


def check_installed(cfg: Metrics) -> None:
    """Refuse metrics.enable_wandb when wandb cannot be imported, naming the extra that installs it."""
    if cfg.enable_wandb:
        try:
            import wandb  # noqa: F401
        except ImportError:
            raise ConfigError(f"metrics.enable_wandb needs the wandb package: {INSTALL}") from None


def start_run(dump_folder: Path, cfg: Metrics, config_text: str, resume_step: int):
    """This launch's W&B run, with the resolved config (`config_text`, the TOML of config.toml) and the git
    commit as its config. Keys left empty go to wandb as None, so that its WANDB_* variables decide."""
    import wandb

    id_file = dump_folder / RUN_ID_FILE
    run_id = id_file.read_text().strip() if resume_step and id_file.is_file() else None
    try:
        run = wandb.init(
            dir=dump_folder, id=run_id, resume="allow" if run_id else None,
            project=cfg.wandb_project or None, name=cfg.wandb_run_name or None, group=cfg.wandb_group or None,
            tags=cfg.wandb_tags or None, config=tomllib.loads(config_text) | {"git_commit": git_commit()},
        )
    except wandb.errors.Error as e:  # not logged in, no network, a wrong entity or project: said in one line
        reason = " ".join(str(e).split())
        raise ConfigError(f"metrics.enable_wandb: W&B could not start a run ({reason}); log in with `wandb login` "
                          "(or set WANDB_API_KEY), or log offline with WANDB_MODE=offline") from None
    id_file.write_text(run.id)
    return run


def histogram(values):
    """A W&B histogram of a tensor's values."""
    import wandb

    return wandb.Histogram(values.detach().float().cpu().numpy())
