"""The composed config for a plain override list, as the tests and benchmarks that sweep many of them write it.

``compose()`` already caches verl's composed defaults per config-group choice, so this is a thin call.
"""

from __future__ import annotations

from collections.abc import Sequence

from verl_safe_launch.compose import Composed, compose
from verl_safe_launch.inputs import ComposeRequest, cli_tokens


def recompose(overrides: Sequence[str]) -> Composed:
    """The composed config for ``overrides`` (command-line tokens, group choices such as model_engine included)."""
    return compose(ComposeRequest(overrides=cli_tokens(list(overrides))))
