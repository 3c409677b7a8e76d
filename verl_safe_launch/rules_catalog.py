"""Importing this module registers every batch, layout, mode, rollout, cluster and verl rule in ``RULES``."""

from verl_safe_launch import rules_batch, rules_cluster, rules_layout, rules_modes, rules_rollout, rules_verl

__all__ = ["rules_batch", "rules_cluster", "rules_layout", "rules_modes", "rules_rollout", "rules_verl"]
