"""Read raw bash launch scripts: every ``python -m verl.trainer.main_ppo`` launch with its overrides and lines."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from verl_safe_launch.errors import InputError
from verl_safe_launch.inputs import ComposeRequest, OverrideToken, verl_config_dir, verl_package_dir
from verl_safe_launch.provenance import Layer, Source
from verl_safe_launch.shell.cases import Cases, Step
from verl_safe_launch.shell.expand import OPAQUE, Env, Expander, Field, apply_assignments
from verl_safe_launch.shell.words import ArrayAssign, Op, PartKind, ShellSyntaxError, Token, Word, lex

MODULE = "verl.trainer.main_ppo"
_SEPARATORS = frozenset({"\n", ";", "&", "&&", "||", "|", "|&", ";;", "(", ")"})
_REDIRECTS = frozenset({">", ">>", "<", "<<<", "&>", ">&", "<&"})
_OPENERS = frozenset({"if", "while", "until", "for", "case", "select"})
_CLOSERS = frozenset({"fi", "done", "esac"})
_PREFIX_WORDS = frozenset({"then", "else", "elif", "do", "!", "{", "}", "time", "exec", "nohup", "command"})
_DECLARE = frozenset({"export", "declare", "typeset", "local", "readonly"})
_HYDRA_VALUE_FLAGS = frozenset(
    {"--cfg", "-c", "--package", "-p", "--experimental-rerun", "--config-dir", "-cd"}
)
_CONFIG_PATH_FLAGS = frozenset({"--config-path", "-cp"})
_CONFIG_NAME_FLAGS = frozenset({"--config-name", "-cn"})
DEPRECATED_CONFIG_NAMES = {"ppo_megatron_trainer": "model_engine=megatron"}


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
class ScriptLaunch:
    """One ``python -m verl.trainer.main_ppo`` launch in a script: its overrides, in order, with their lines."""

    path: str
    line: int
    index: int
    tokens: tuple[OverrideToken, ...]
    config_files: tuple[Path, ...] = ()
    passthrough: Passthrough | None = None
    notes: tuple[ScriptNote, ...] = ()

    @property
    def label(self) -> str:
        """``run.sh:12`` (the line where the launch command starts)."""
        return f"{self.path}:{self.line}"

    def request(self, passthrough: tuple[OverrideToken, ...] = (), *, lenient: bool = True) -> ComposeRequest:
        """The compose request: the script's overrides with ``passthrough`` inserted where ``"$@"`` stands."""
        at = self.passthrough.position if self.passthrough else len(self.tokens)
        tokens = (*self.tokens[:at], *passthrough, *self.tokens[at:])
        return ComposeRequest(overrides=tokens, config_files=self.config_files, lenient=lenient)


def read_script(path: Path | str) -> tuple[ScriptLaunch, ...]:
    """Read a launch script; raise InputError when it is unreadable, not shell, or launches nothing."""
    path = Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise InputError(f"script not found: {path}", fix="check the path of the launch script") from None
    except OSError as exc:
        raise InputError(f"cannot read {path}: {exc.strerror or exc}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(
            f"{path} is not a text file (byte {exc.start} is not UTF-8)",
            fix="pass a bash launch script",
        ) from None
    launches = parse_script(text, str(path), base_dir=path.parent)
    if not launches:
        raise InputError(
            f"no 'python -m {MODULE}' launch found in {path}",
            where=str(path),
            fix=f"audit a script that runs python3 -m {MODULE} key=value ...",
        )
    return launches


def parse_script(text: str, name: str, base_dir: Path | None = None) -> tuple[ScriptLaunch, ...]:
    """Every launch in the script text (possibly none); raise InputError on invalid shell syntax."""
    try:
        tokens = lex(text.replace("\r\n", "\n"))
    except ShellSyntaxError as exc:
        raise InputError(
            f"cannot read {name}: {exc.message}",
            where=f"{name}:{exc.line}",
            fix="check the quotes and brackets on that line (bash -n runs the same check)",
        ) from None
    return _Reader(name).run(tokens)


@dataclass
class _Command:
    items: list[Word | ArrayAssign] = field(default_factory=list)
    function_header: bool = False
    end: str = "\n"


def _commands(tokens: list[Token]) -> list[_Command]:
    """Split tokens into simple commands; redirections and their targets are dropped."""
    commands: list[_Command] = [_Command()]
    skip_next = False
    for token in tokens:
        if skip_next and isinstance(token, Word):
            skip_next = False
            continue
        skip_next = False
        if isinstance(token, Op):
            if token.text in _SEPARATORS:
                commands[-1].end = token.text
                commands.append(_Command())
            elif token.text in _REDIRECTS:
                skip_next = True
            elif token.text == "()":
                commands[-1].function_header = True
            continue
        commands[-1].items.append(token)
    return [c for c in commands if c.items or c.end == ";;"]


class _Reader:
    def __init__(self, name: str) -> None:
        self.name = name
        self.env: Env = {}
        self.notes: list[ScriptNote] = []
        self.depth = 0
        self.function_depth = 0
        self.launches: list[ScriptLaunch] = []
        self.cases = Cases()

    def run(self, tokens: list[Token]) -> tuple[ScriptLaunch, ...]:
        for command in _commands(tokens):
            read = self.function_depth or self.cases.step(command.items, command.end, self.env) is Step.READ
            if read and command.items:
                self._command(command)
        return tuple(self.launches)

    def _command(self, command: _Command) -> None:
        items = list(command.items)
        if self._in_function(items, command.function_header):
            return
        items = self._strip_keywords(items)
        if not items:
            return
        first = _literal(items[0])
        if first in _DECLARE:
            items = [i for i in items[1:] if not (_literal(i) or "").startswith("-")]
            self._assign(items, declared=True)
            return
        if first == "unset":
            for item in items[1:]:
                self.env.pop(_literal(item) or "", None)
            return
        if first in ("source", "."):
            self.notes.append(
                ScriptNote("sourced", _line(items[0]), _raw(items), "variables it sets are unknown")
            )
            return
        rest = self._assign(items, declared=False)
        if rest:
            self._maybe_launch(rest)

    def _in_function(self, items: list[Word | ArrayAssign], header: bool) -> bool:
        words = [_literal(i) for i in items]
        if self.function_depth:
            self.function_depth += words.count("{") - words.count("}")
            self.function_depth = max(self.function_depth, 0)
            return True
        if header or words[0] == "function":
            self.function_depth = max(words.count("{") - words.count("}"), 0)
            if "{" not in words:
                self.function_depth = 1
            return True
        return False

    def _strip_keywords(self, items: list[Word | ArrayAssign]) -> list[Word | ArrayAssign]:
        while items:
            word = _literal(items[0])
            if word in _OPENERS:
                self.depth += 1
                if word in ("for", "case", "select"):
                    return []
            elif word in _CLOSERS:
                self.depth = max(self.depth - 1, 0)
            elif word not in _PREFIX_WORDS:
                break
            items = items[1:]
        return items

    def _assign(self, items: list[Word | ArrayAssign], *, declared: bool) -> list[Word | ArrayAssign]:
        """Apply leading assignments; return the rest of the command (empty when it was only assignments)."""
        count = 0
        while count < len(items) and _is_assignment(items[count]):
            count += 1
        if count and (count == len(items) or declared):
            conditional = self.depth > 0
            notes = apply_assignments(self.env, items[:count], conditional=conditional)
            self.notes.extend(ScriptNote("env-default", n.line, n.raw, n.detail) for n in notes)
        return [] if declared else items[count:]

    def _maybe_launch(self, items: list[Word | ArrayAssign]) -> None:
        words = [i for i in items if isinstance(i, Word)]
        if not any("main_ppo" in w.raw or "$" in w.raw for w in words):
            return
        expander = Expander(self.env)
        fields = [f for w in words for f in expander.word(w)]
        start = _module_end(fields)
        if start is None:
            return
        notes = [*self.notes, *(ScriptNote("env-default", n.line, n.raw, n.detail) for n in expander.notes)]
        launch = _LaunchBuilder(self.name, len(self.launches) + 1, words[0].line, notes, self.depth > 0)
        self.launches.append(launch.build(fields[start:]))


def traced_launches(
    name: str, calls: tuple[tuple[str, ...], ...], static: tuple[ScriptLaunch, ...] = ()
) -> tuple[ScriptLaunch, ...]:
    """The launches in command lines bash really ran; lines are taken from the statically read launch."""
    launches: list[ScriptLaunch] = []
    for argv in calls:
        lines = _lines_by_text(static[len(launches)] if len(launches) < len(static) else None)
        fields = [Field(word, lines.get(word, 0), word) for word in argv]
        start = _module_end(fields)
        if start is None:
            continue
        line = static[len(launches)].line if len(launches) < len(static) else 0
        builder = _LaunchBuilder(name, len(launches) + 1, line, [], False)
        launches.append(builder.build(fields[start:]))
    return tuple(launches)


def _lines_by_text(launch: ScriptLaunch | None) -> dict[str, int]:
    if launch is None:
        return {}
    return {t.text: t.source.line or launch.line for t in launch.tokens}


def _module_end(fields: list[Field]) -> int | None:
    for i, f in enumerate(fields):
        text = f.text if f.problem is None else ""
        if text == "-m" and i + 1 < len(fields) and fields[i + 1].text == MODULE:
            return i + 2
        if text == f"-m{MODULE}" or text.endswith("verl/trainer/main_ppo.py"):
            return i + 1
    return None


class _LaunchBuilder:
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
        files, group = self._config()
        tokens = (*group, *self.tokens)
        shift = len(group)
        passthrough = self.passthrough
        if passthrough and shift:
            passthrough = Passthrough(passthrough.position + shift, passthrough.line, passthrough.raw)
        return ScriptLaunch(self.name, self.line, self.index, tokens, files, passthrough, tuple(self.notes))

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
                self._flag_value(flag, f)
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

    def _config(self) -> tuple[tuple[Path, ...], tuple[OverrideToken, ...]]:
        """``--config-path``/``--config-name``: verl's own config, its deprecated alias, or a user YAML layer."""
        name_field, path_field = self.config_name, self.config_path
        if name_field is None and path_field is None:
            return (), ()
        for f in (path_field, name_field):
            if f is not None and f.problem is not None:
                self.notes.append(
                    ScriptNote("config", f.line, f.raw, f"{f.problem}; the config file is not audited", None)
                )
                return (), ()
        name = (name_field.text if name_field else "ppo_trainer").removesuffix(".yaml")
        directory = _config_dir(path_field.text if path_field else "config")
        where = name_field or path_field
        assert where is not None
        if directory is not None and directory == verl_config_dir().resolve():
            return (), self._verl_config(name, where)
        if directory is None or not (directory / f"{name}.yaml").is_file():
            shown = f"{path_field.text if path_field else 'config'}/{name}.yaml"
            self.notes.append(
                ScriptNote(
                    "config", where.line, where.raw, f"config file {shown} not found; not audited", None
                )
            )
            return (), ()
        path = directory / f"{name}.yaml"
        return (path,), self._inherited(path, where)

    def _inherited(self, path: Path, where: Field) -> tuple[OverrideToken, ...]:
        """The verl config a user config inherits (its ``defaults``): megatron's becomes ``model_engine=megatron``."""
        entries = _defaults_of(path)
        bases = [e for e in entries or () if e != "_self_"]
        if entries is None or any(b not in ("ppo_trainer", *DEPRECATED_CONFIG_NAMES) for b in bases):
            detail = (
                f"{path.name} has a defaults list this reader does not compose ({entries}); keys not checked"
            )
            self.notes.append(ScriptNote("config", where.line, where.raw, detail, None))
            return ()
        source = Source(Layer.SCRIPT, self.name, where.line, raw=where.raw)
        return tuple(
            OverrideToken(DEPRECATED_CONFIG_NAMES[b], source) for b in bases if b in DEPRECATED_CONFIG_NAMES
        )

    def _verl_config(self, name: str, where: Field) -> tuple[OverrideToken, ...]:
        if name == "ppo_trainer":
            return ()
        if name in DEPRECATED_CONFIG_NAMES:
            text = DEPRECATED_CONFIG_NAMES[name]
            self.notes.append(ScriptNote("deprecated-config", where.line, where.raw, text))
            return (OverrideToken(text, Source(Layer.SCRIPT, self.name, where.line, raw=where.raw)),)
        self.notes.append(
            ScriptNote(
                "config", where.line, where.raw, f"verl config '{name}' is not the PPO trainer's", None
            )
        )
        return ()


def _defaults_of(path: Path) -> list[str] | None:
    """The plain entries of a config file's ``defaults`` list; None when it has entries of another form."""
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    defaults = data.get("defaults", []) if isinstance(data, dict) else []
    if not isinstance(defaults, list) or not all(isinstance(e, str) for e in defaults):
        return None
    return [e.removesuffix(".yaml") for e in defaults]


def override_key(text: str) -> str | None:
    """The key of an override whose key is written out (``key=$X``, ``+key=...``), else None."""
    key, eq, _ = text.lstrip("+~").partition("=")
    if not eq or not key or OPAQUE in key or any(c.isspace() for c in key):
        return None
    return key


def _config_dir(text: str) -> Path | None:
    """Hydra's rule: an absolute path as is, a relative one inside the package of ``main_ppo``."""
    path = Path(text).expanduser()
    candidate = path if path.is_absolute() else verl_package_dir() / "trainer" / path
    try:
        return candidate.resolve() if candidate.is_dir() else None
    except OSError:
        return None


def _dedupe(notes: list[ScriptNote]) -> list[ScriptNote]:
    seen: set[tuple[str, int, str]] = set()
    out: list[ScriptNote] = []
    for note in notes:
        key = (note.kind, note.line, note.raw)
        if key not in seen:
            seen.add(key)
            out.append(note)
    return out


def _literal(item: Word | ArrayAssign) -> str | None:
    """The word's text when it is one unquoted literal (keywords, command names), else None."""
    if isinstance(item, Word) and len(item.parts) == 1 and not item.parts[0].quoted:
        part = item.parts[0]
        return part.text if part.kind is PartKind.LIT else None
    return None


def _is_assignment(item: Word | ArrayAssign) -> bool:
    if isinstance(item, ArrayAssign):
        return True
    first = item.parts[0] if item.parts else None
    if first is None or first.kind is not PartKind.LIT or first.quoted:
        return False
    name, eq, _ = first.text.partition("=")
    return bool(eq) and name.rstrip("+").isidentifier() and name.rstrip("+").isascii()


def _line(item: Word | ArrayAssign) -> int:
    return item.line


def _raw(items: list[Word | ArrayAssign]) -> str:
    return " ".join(i.raw for i in items)


__all__ = [
    "Passthrough",
    "ScriptLaunch",
    "ScriptNote",
    "override_key",
    "parse_script",
    "read_script",
    "traced_launches",
]
