"""verl's own validation of a release, run in a process that imports that release (``PYTHONPATH=DIR``).

Read by ``python tests/release_oracle.py < configs.json``: a JSON list of composed configs (interpolations
unresolved); prints one verdict per config (None: the release accepts it). Each release is called the way its
``main_ppo`` calls it: ``verl.utils.config.validate_config`` from 0.6 on, ``RayPPOTrainer._validate_config``
(run by the trainer's ``__init__``) before. transformers in this environment no longer has
``AutoModelForVision2Seq``, which verl 0.6.1 imports by name; it is given the class that replaced it.
"""

from __future__ import annotations

import contextlib
import io
import json
import sys
import warnings
from typing import Any


def _environment() -> None:
    import transformers

    if not hasattr(transformers, "AutoModelForVision2Seq"):
        transformers.AutoModelForVision2Seq = transformers.AutoModelForImageTextToText


def _validate(cfg: Any) -> None:
    try:
        from verl.utils.config import validate_config
    except ImportError:
        from verl.trainer.ppo.ray_trainer import RayPPOTrainer

        trainer = object.__new__(RayPPOTrainer)
        trainer.config = cfg
        trainer.use_reference_policy = bool(
            cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss
        )
        trainer.use_critic = cfg.algorithm.adv_estimator == "gae"
        trainer._validate_config()
        return
    use_ref = bool(cfg.algorithm.use_kl_in_reward or cfg.actor_rollout_ref.actor.use_kl_loss)
    from verl.trainer.ppo.utils import need_critic

    validate_config(config=cfg, use_reference_policy=use_ref, use_critic=need_critic(cfg))


def verdict(container: Any) -> str | None:
    """None when the release accepts the config, else its error."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.create(container)
    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
        warnings.simplefilter("ignore")
        try:
            _validate(cfg)
        except Exception as exc:  # verl raises ValueError, AssertionError, TypeError
            return f"{type(exc).__name__}: {' '.join(str(exc).split())}"[:300]
    return None


if __name__ == "__main__":
    _environment()
    print(json.dumps([verdict(c) for c in json.load(sys.stdin)]))
