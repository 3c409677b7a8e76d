"""verl's own config files in a composition's read budget: scanned once per verl copy, before Hydra reads them."""

from __future__ import annotations

from verl_safe_launch.errors import InputError
from verl_safe_launch.inputs.knowledge import cached_fact
from verl_safe_launch.inputs.read_budget import MAX_VALUES, charge, composition_budget, values_left
from verl_safe_launch.inputs.verl_paths import display_path, verl_cache, verl_config_dir
from verl_safe_launch.inputs.yamlfile import read_yaml

FACT = "yaml-values"


@verl_cache
def verl_yaml_values() -> int:
    """The values of every YAML file in the config directory of the verl in use, aliases counted at every use.

    Each file is read as a user's is (a regular file, 1 MiB, no alias bomb); a file past the budget is an
    InputError naming it. The count is cached with the verl copy's other facts.
    """
    found = cached_fact(FACT, _scan)
    return int(found) if isinstance(found, int) else _scan()


def _scan() -> int:
    total = 0
    with composition_budget():
        for path in sorted(verl_config_dir().rglob("*.yaml")):
            before = values_left()
            read_yaml(path, expand_dots=False)
            total += before - values_left()
    return total


def charge_verl_yaml() -> None:
    """Draw verl's own config files from the current composition's budget (see ``read_budget``)."""
    values = verl_yaml_values()
    if values > values_left():
        raise InputError(
            f"verl's config files ({display_path(verl_config_dir())}) hold {values:,} YAML values, more than the "
            f"{values_left():,} left of the {MAX_VALUES:,} one composition may read",
            where=str(verl_config_dir()),
            fix="check the verl copy in use (--verl, or a vendored verl/): its config files are far larger than "
            "a release's",
        )
    charge(values, "verl's config files")


__all__ = ["charge_verl_yaml", "verl_yaml_values"]
