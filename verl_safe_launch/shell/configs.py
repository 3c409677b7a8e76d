"""Which config a launch composes: its ``--config-path``/``--config-name``, resolved as the verl in use would.

A name in verl's own config directory is composed by that name (``ppo_megatron_trainer`` is a real config in
0.5 to 0.7, and an alias of ``model_engine=megatron`` from 0.8); a user config file is laid over the verl config
its ``defaults`` names. A path that starts with the working directory (``$(pwd)/...``, ``$PWD/...``) is read from
the script's directory or the directories above it, up to the project's root, where the file is found.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from verl_safe_launch.inputs import (
    PRIMARY_CONFIG,
    project_dirs,
    verl_config_dir,
    verl_package_dir,
    verl_release,
)
from verl_safe_launch.shell.expand import OPAQUE, WORKDIR

WORKDIR_TEXTS = (OPAQUE + WORKDIR, "$PWD", "${PWD}")
"""How a path that starts with the working directory reads after expansion."""


@dataclass(frozen=True)
class ConfigChoice:
    """What ``--config-path``/``--config-name`` make Hydra compose.

    ``config_name``: the config of verl's own directory composed first; ``files``: a user config file laid over
    it; ``notes``: (kind, detail, unread) for the report, where ``unread`` means the config was not read (any
    key could come from it).
    """

    config_name: str = PRIMARY_CONFIG
    files: tuple[Path, ...] = ()
    notes: tuple[tuple[str, str, bool], ...] = ()


def choose_config(name: str | None, path: str | None, script: Path | None) -> ConfigChoice:
    """The config a launch with ``--config-name name --config-path path`` composes (either may be None)."""
    name = (name or PRIMARY_CONFIG).removesuffix(".yaml")
    shown = f"{path if path is not None else 'config'}/{name}.yaml"
    text = path if path is not None else "config"
    directory, how = _config_dir(text, name, script)
    if directory is None:
        if OPAQUE not in text and "$" not in text:
            detail = f"Hydra finds no config directory {text}, and stops before verl starts"
            return ConfigChoice(notes=(("config-missing", detail, False),))
        return ConfigChoice(
            notes=(("config", f"config file {_readable(shown)} not found; not audited", True),)
        )
    assumed = (("config-path", how, False),) if how else ()
    if directory == verl_config_dir().resolve():
        choice = verl_config(name)
    else:
        choice = _user_config(directory / f"{name}.yaml")
    return ConfigChoice(choice.config_name, choice.files, assumed + choice.notes)


def verl_config(name: str) -> ConfigChoice:
    """verl's own config ``name``, composed by that name (a deprecated alias is named as such)."""
    if name == PRIMARY_CONFIG:
        return ConfigChoice()
    path = verl_config_dir() / f"{name}.yaml"
    text = _text(path)
    if text is None:
        detail = f"{verl_release().name} has no config '{name}', so Hydra stops before verl starts"
        return ConfigChoice(notes=(("config-missing", detail, False),))
    if "actor_rollout_ref" not in text and PRIMARY_CONFIG not in text:
        return ConfigChoice(notes=(("config", f"verl config '{name}' is not the PPO trainer's", True),))
    notes: tuple[tuple[str, str, bool], ...] = ()
    head = "\n".join(line for line in text.splitlines()[:5] if line.startswith("#"))
    if "deprecated" in head.lower():
        replaced = " ".join(_group_overrides(path)) or PRIMARY_CONFIG
        notes = (("deprecated-config", replaced, False),)
    return ConfigChoice(name, (), notes)


def _user_config(path: Path) -> ConfigChoice:
    """A user config file, laid over the one verl config its ``defaults`` names (``ppo_trainer`` if none)."""
    if not path.is_file():
        detail = f"Hydra finds no {path.name} in {path.parent}, and stops before verl starts"
        return ConfigChoice(notes=(("config-missing", detail, False),))
    entries = _defaults_of(path)
    bases = [e for e in entries or () if e != "_self_"]
    known = [b for b in bases if (verl_config_dir() / f"{b}.yaml").is_file()]
    if entries is None or len(bases) > 1 or known != bases:
        detail = f"{path.name} has a defaults list this reader does not compose ({entries}); keys not checked"
        return ConfigChoice(notes=(("config", detail, True),))
    base = verl_config(bases[0]) if bases else ConfigChoice()
    return ConfigChoice(base.config_name, (path,), base.notes)


def _config_dir(text: str, name: str, script: Path | None) -> tuple[Path | None, str]:
    """Hydra's rule: an absolute path as is, a relative one inside the package of ``main_ppo``; one that starts
    with the working directory is looked for from the script's directory up. Also says what was assumed."""
    start = next((t for t in WORKDIR_TEXTS if text.startswith(t)), None)
    if start is not None:
        rest = text[len(start) :].lstrip("/")
        if OPAQUE in rest or "$" in rest or script is None:
            return None, ""
        for base in project_dirs(script.resolve().parent):
            if (base / rest / f"{name}.yaml").is_file():
                return (base / rest).resolve(), f"the working directory read as {base}, where {rest} is"
        return None, ""
    if OPAQUE in text or "$" in text:
        return None, ""
    path = Path(text).expanduser()
    candidate = path if path.is_absolute() else verl_package_dir() / "trainer" / path
    try:
        return (candidate.resolve() if candidate.is_dir() else None), ""
    except OSError:
        return None, ""


def _text(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def _readable(text: str) -> str:
    return text.replace(OPAQUE + WORKDIR, "$(pwd)").replace(OPAQUE, "...")


def _defaults(path: Path) -> list[object] | None:
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    defaults = data.get("defaults", []) if isinstance(data, dict) else []
    return defaults if isinstance(defaults, list) else None


def _defaults_of(path: Path) -> list[str] | None:
    """The plain entries of a config file's ``defaults`` list; None when it has entries of another form."""
    defaults = _defaults(path)
    if defaults is None or not all(isinstance(e, str) for e in defaults):
        return None
    return [str(e).removesuffix(".yaml") for e in defaults]


def _group_overrides(path: Path) -> list[str]:
    """``model_engine=megatron`` for each ``override model_engine: megatron`` entry of a config's defaults."""
    out: list[str] = []
    for entry in _defaults(path) or []:
        if isinstance(entry, dict):
            for key, value in entry.items():
                if str(key).startswith("override "):
                    out.append(f"{str(key).removeprefix('override ').strip()}={value}")
    return out
