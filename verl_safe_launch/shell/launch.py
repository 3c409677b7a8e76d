"""One verl launch of a script: its overrides with their lines, Hydra's flags, and the parts not read."""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from verl_safe_launch.errors import UsageError
from verl_safe_launch.inputs import PRIMARY_CONFIG, ComposeRequest, OverrideToken
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell.configs import ConfigChoice, choose_config
from verl_safe_launch.shell.expand import OPAQUE, Field

MODULE = "verl.trainer.main_ppo"
_HYDRA_VALUE_FLAGS = frozenset(
    {"--cfg", "-c", "--package", "-p", "--experimental-rerun", "--config-dir", "-cd"}
)
_CONFIG_PATH_FLAGS = frozenset({"--config-path", "-cp"})
_CONFIG_NAME_FLAGS = frozenset({"--config-name", "-cn"})


@dataclass(frozen=True)
class ScriptNote:
    """Something in a launch the reader did not turn into an override: kind, line, raw text and why.

    A part the reader could not read says which keys it could set: ``supplies`` names them, ``None`` means any
    key; ``position`` is the number of overrides before it (Hydra keeps the last value of a key).
    """

    kind: str
    line: int
    raw: str
    detail: str
    supplies: tuple[str, ...] | None = ()
    position: int = 0

    @property
    def unread(self) -> bool:
        """True when this part could set a value the reader did not see."""
        return self.supplies is None or bool(self.supplies)


@dataclass(frozen=True)
class Passthrough:
    """Where a launch passes the script's own arguments (``"$@"``) to verl."""

    position: int
    line: int
    raw: str


@dataclass(frozen=True)
class Export:
    """A variable the script exports before a launch, with the value it has there: the run's environment."""

    name: str
    value: str
    line: int


@dataclass(frozen=True)
class ScriptLaunch:
    """One ``python -m verl.trainer.main_ppo`` launch in a script: its overrides, in order, with their lines."""

    path: str
    line: int
    index: int
    tokens: tuple[OverrideToken, ...]
    config_files: tuple[Path, ...] = ()
    passthrough: Passthrough | None = None
    notes: tuple[ScriptNote, ...] = ()
    exports: tuple[Export, ...] = ()
    """Exported variables with known values when the launch runs (``export VLLM_ATTENTION_BACKEND=...``)."""
    worlds: tuple[ScriptLaunch, ...] = ()
    """The launch as read in every possible world (one branch of each if/case the script does not decide)."""
    branch: str = ""
    """In a possible world: the branches it takes (``the if on line 4 takes branch 2``)."""
    config_name: str = PRIMARY_CONFIG
    """The verl config it composes first (``--config-name``, or the one its own config file names)."""

    @property
    def label(self) -> str:
        """``run.sh:12`` (the line where the launch command starts)."""
        return f"{self.path}:{self.line}"

    def request(self, passthrough: tuple[OverrideToken, ...] = (), *, lenient: bool = True) -> ComposeRequest:
        """The compose request: the script's overrides with ``passthrough`` inserted where ``"$@"`` stands."""
        at = self.passthrough.position if self.passthrough else len(self.tokens)
        tokens = (*self.tokens[:at], *passthrough, *self.tokens[at:])
        files = self.config_files
        return ComposeRequest(
            overrides=tokens,
            config_files=files,
            lenient=lenient,
            named_configs=files,
            config_name=self.config_name,
        )


def traced_launches(
    name: str,
    calls: tuple[tuple[str, ...], ...],
    static: tuple[ScriptLaunch, ...] = (),
    passthrough: tuple[OverrideToken, ...] = (),
) -> tuple[ScriptLaunch, ...]:
    """The launches in command lines bash really ran; lines are taken from the statically read launch.

    Where the static read saw ``"$@"``, the script's arguments (``passthrough``, as bash got them) keep their
    own source: they were passed to the script, not written in it.
    """
    launches: list[ScriptLaunch] = []
    for argv in calls:
        known = static[len(launches)] if len(launches) < len(static) else None
        line = known.line if known is not None else 0
        lines = _lines_by_text(known)
        fields = [Field(word, lines.get(word, line), word) for word in argv]
        start = module_end(fields)
        if start is None:
            continue
        builder = LaunchBuilder(name, len(launches) + 1, line, [], False)
        launch = builder.build(fields[start:])
        if known is not None and known.passthrough is not None and passthrough:
            launch = _with_arguments(launch, passthrough, known.passthrough.line)
        launches.append(launch)
    return tuple(launches)


def _with_arguments(launch: ScriptLaunch, args: tuple[OverrideToken, ...], line: int) -> ScriptLaunch:
    """The launch with its last run of the script's arguments taken back to their own source."""
    texts = [t.text for t in launch.tokens]
    wanted = [t.text for t in args]
    for at in range(len(texts) - len(wanted), -1, -1):
        if texts[at : at + len(wanted)] == wanted:
            own = tuple(replace(t, source=replace(t.source, line=line)) for t in args)
            tokens = (*launch.tokens[:at], *own, *launch.tokens[at + len(wanted) :])
            return replace(launch, tokens=tokens)
    return launch


def _lines_by_text(launch: ScriptLaunch | None) -> dict[str, int]:
    if launch is None:
        return {}
    return {t.text: t.source.line or launch.line for t in launch.tokens}


def module_end(fields: list[Field]) -> int | None:
    for i, f in enumerate(fields):
        text = f.text if f.problem is None else ""
        if text == "-m" and i + 1 < len(fields) and fields[i + 1].text == MODULE:
            return i + 2
        if text == f"-m{MODULE}" or text.endswith("verl/trainer/main_ppo.py"):
            return i + 1
    return None


class LaunchBuilder:
    """Builds one launch from the fields after ``-m verl.trainer.main_ppo``."""

    def __init__(self, name: str, index: int, line: int, notes: list[ScriptNote], conditional: bool) -> None:
        self.name = name
        self.index = index
        self.line = line
        self.notes = list(_dedupe(notes))
        if conditional:
            self.notes.append(
                ScriptNote("conditional", line, MODULE, "this launch runs inside an if/for block")
            )
        self.tokens: list[OverrideToken] = []
        self.passthrough: Passthrough | None = None
        self.config_path: Field | None = None
        self.config_name: Field | None = None

    def build(self, fields: list[Field]) -> ScriptLaunch:
        pending: str | None = None
        for f in fields:
            if pending is not None:
                self._flag_value(pending, f)
                pending = None
            else:
                pending = self._field(f)
        choice, group = self._config()
        tokens = (*group, *self.tokens)
        shift = len(group)
        passthrough = self.passthrough
        if passthrough and shift:
            passthrough = Passthrough(passthrough.position + shift, passthrough.line, passthrough.raw)
        return ScriptLaunch(
            self.name,
            self.line,
            self.index,
            tokens,
            choice.files,
            passthrough,
            tuple(self.notes),
            config_name=choice.config_name,
        )

    def _field(self, f: Field) -> str | None:
        if f.args:
            if self.passthrough is None:
                self.passthrough = Passthrough(len(self.tokens), f.line, f.raw)
            return None
        if f.maybe is not None:
            self._unread("maybe", f, f.maybe)
            return None
        if f.problem is not None:
            flag = f.raw.strip("'\"").partition("=")[0]
            if flag in _CONFIG_PATH_FLAGS | _CONFIG_NAME_FLAGS:
                head, eq, value = f.text.partition("=")
                self._flag_value(flag, replace(f, text=value) if eq and head == flag else f)
            else:
                self._unread("unresolved", f, f.problem)
            return None
        flag, eq, value = f.text.partition("=")
        if flag in _CONFIG_PATH_FLAGS | _CONFIG_NAME_FLAGS | _HYDRA_VALUE_FLAGS:
            if eq:
                self._flag_value(flag, Field(value, f.line, f.raw))
                return None
            return flag
        if f.text.startswith("-"):
            self.notes.append(
                ScriptNote("hydra-option", f.line, f.raw, "Hydra command-line option, not a config value")
            )
            return None
        key = f.text.lstrip("+~").partition("=")[0]
        if key == "hydra" or key.startswith("hydra."):
            self.notes.append(
                ScriptNote("hydra-option", f.line, f.raw, "Hydra runtime setting, not part of verl's config")
            )
            return None
        if f.machine is not None:
            detail = f"${f.machine}, which differs from machine to machine"
            self.notes.append(ScriptNote("machine", f.line, f.text, detail, (), len(self.tokens)))
        self.tokens.append(OverrideToken(f.text, Source(Layer.SCRIPT, self.name, f.line, raw=f.raw)))
        return None

    def _unread(self, kind: str, f: Field, detail: str) -> None:
        """A part whose value (or presence) is unknown: the key it sets when that much is written out."""
        key = override_key(f.text)
        if key is not None and (key == "hydra" or key.startswith(("hydra.", "-"))):
            supplies: tuple[str, ...] | None = ()
        else:
            supplies = (key,) if key is not None else None
        self.notes.append(ScriptNote(kind, f.line, f.raw, detail, supplies, len(self.tokens)))

    def _flag_value(self, flag: str, value: Field) -> None:
        if flag in _CONFIG_PATH_FLAGS:
            self.config_path = value
        elif flag in _CONFIG_NAME_FLAGS:
            self.config_name = value
        else:
            raw = value.raw if value.raw.startswith(flag) else f"{flag} {value.raw}"
            self.notes.append(
                ScriptNote("hydra-option", value.line, raw, "Hydra command-line option, not a config value")
            )

    def _config(self) -> tuple[ConfigChoice, tuple[OverrideToken, ...]]:
        """``--config-path``/``--config-name``: verl's own config by name, or a user YAML layer over one."""
        name_field, path_field = self.config_name, self.config_path
        if name_field is None and path_field is None:
            return ConfigChoice(), ()
        where = name_field or path_field
        assert where is not None
        if name_field is not None and name_field.problem is not None:
            note = f"{name_field.problem}; the config file is not audited"
            self.notes.append(ScriptNote("config", where.line, where.raw, note, None))
            return ConfigChoice(), ()
        path_text = path_field.text if path_field is not None else None
        choice = choose_config(name_field.text if name_field else None, path_text, Path(self.name))
        for kind, detail, unread in choice.notes:
            from_path = path_field is not None and (kind == "config-path" or path_field.problem is not None)
            shown = path_field if from_path and path_field is not None else where
            if kind == "config" and path_field is not None and path_field.problem is not None:
                detail = f"{path_field.problem}; {detail}"
            self.notes.append(ScriptNote(kind, shown.line, shown.raw, detail, None if unread else ()))
        return choice, ()


def override_key(text: str) -> str | None:
    """The key of an override whose key is written out (``key=$X``, ``+key=...``), else None."""
    key, eq, _ = text.lstrip("+~").partition("=")
    if not eq or not key or OPAQUE in key or any(c.isspace() for c in key):
        return None
    return key


def _dedupe(notes: list[ScriptNote]) -> list[ScriptNote]:
    seen: set[tuple[str, int, str]] = set()
    out: list[ScriptNote] = []
    for note in notes:
        key = (note.kind, note.line, note.raw)
        if key not in seen:
            seen.add(key)
            out.append(note)
    return out


def choose_launch(launches: tuple[ScriptLaunch, ...], wanted: int | None, script: str) -> ScriptLaunch:
    """The launch ``--launch N`` names, or the only one; a usage error otherwise."""
    if wanted is None and len(launches) == 1:
        return launches[0]
    choices = ", ".join(f"{launch.index} (line {launch.line})" for launch in launches)
    if wanted is None:
        raise UsageError(
            f"{script} has {len(launches)} launches: {choices}", fix="choose one with --launch N"
        )
    if not 1 <= wanted <= len(launches):
        raise UsageError(f"{script} has no launch {wanted}", where="--launch", fix=f"use one of: {choices}")
    return launches[wanted - 1]


__all__ = [
    "MODULE",
    "LaunchBuilder",
    "Passthrough",
    "ScriptLaunch",
    "ScriptNote",
    "choose_launch",
    "module_end",
    "override_key",
    "traced_launches",
]
