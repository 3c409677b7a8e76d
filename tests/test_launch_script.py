"""The launch-script reader: quoting, continuations, variables, arrays, passthrough, config files, errors."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from conftest import DATA, examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from verl_safe_launch.compose import compose
from verl_safe_launch.errors import InputError
from verl_safe_launch.provenance import Layer
from verl_safe_launch.shell import ScriptLaunch, parse_script, read_script

LAUNCH = "python3 -m verl.trainer.main_ppo"
SCRIPTS = DATA / "scripts"


def one(text: str) -> ScriptLaunch:
    launches = parse_script(text, "run.sh")
    assert len(launches) == 1, launches
    return launches[0]


def texts(launch: ScriptLaunch) -> list[str]:
    return [t.text for t in launch.tokens]


def notes(launch: ScriptLaunch) -> list[tuple[str, int, str]]:
    return [(n.kind, n.line, n.detail) for n in launch.notes]


# --- fixtures modelled on verl's examples -----------------------------------------------------------------

FIXTURES = [
    # script, launches, tokens of the first launch, passthrough line
    ("grpo_gsm8k.sh", 1, 37, 48),
    ("grpo_kl_flip.sh", 1, 21, None),
    ("ppo_critic.sh", 1, 36, 47),
    ("megatron_arrays.sh", 1, 27, 71),
    ("megatron_config_name.sh", 1, 16, None),
    ("megatron_strategy.sh", 1, 8, None),
    ("multiturn.sh", 1, 21, 42),
    ("two_launches.sh", 2, 10, None),
]


@pytest.mark.parametrize(("name", "launches", "tokens", "passthrough"), FIXTURES)
def test_fixture_scripts(name: str, launches: int, tokens: int, passthrough: int | None) -> None:
    found = read_script(SCRIPTS / name)
    assert len(found) == launches
    assert len(found[0].tokens) == tokens
    assert (found[0].passthrough.line if found[0].passthrough else None) == passthrough
    for token in found[0].tokens:
        assert token.source.layer is Layer.SCRIPT
        assert token.source.file == str(SCRIPTS / name)
        assert token.source.line and token.source.raw


def test_tokens_cite_their_lines_and_raw_text() -> None:
    launch = read_script(SCRIPTS / "grpo_gsm8k.sh")[0]
    by_text = {t.text: t.source for t in launch.tokens}
    assert by_text["actor_rollout_ref.rollout.name=vllm"].line == 32
    assert (
        by_text["actor_rollout_ref.rollout.name=vllm"].raw == "actor_rollout_ref.rollout.name=$rollout_name"
    )
    assert by_text["data.truncation=error"].raw == "data.truncation='error'"
    assert by_text['trainer.logger=["console","wandb"]'].line == 41
    assert by_text["actor_rollout_ref.model.path=Qwen/Qwen2.5-3B-Instruct"].line == 20


def test_arrays_keep_the_line_of_each_element() -> None:
    launch = read_script(SCRIPTS / "megatron_arrays.sh")[0]
    by_text = {t.text: t.source for t in launch.tokens}
    assert by_text["data.train_batch_size=1024"].line == 23
    assert by_text["data.train_batch_size=1024"].raw == "data.train_batch_size=${train_batch_size}"
    assert by_text["critic.model.path=Qwen/Qwen3-8B"].line == 46
    assert texts(launch)[-1] == "model_engine=megatron"


def test_a_config_name_of_verl_is_composed_by_that_name() -> None:
    """``--config-name ppo_megatron_trainer``: the config verl's own Hydra composes; 0.9's file says it is a
    deprecated alias, and of what."""
    launch = read_script(SCRIPTS / "megatron_config_name.sh")[0]
    assert launch.config_name == "ppo_megatron_trainer"
    assert launch.request().config_name == "ppo_megatron_trainer"
    assert notes(launch) == [("deprecated-config", 7, "model_engine=megatron")]
    assert compose(launch.request()).view.get("model_engine") == "megatron"


def test_unresolvable_values_are_reported_not_guessed() -> None:
    launch = read_script(SCRIPTS / "multiturn.sh")[0]
    assert not any("$" in t.replace("$HOME", "") for t in texts(launch))
    assert ("unresolved", 36, "the command substitution $(now) (line 15)") in notes(launch)
    assert "data.train_files=$HOME/data/gsm8k/train.parquet" in texts(launch)
    assert (
        "config",
        18,
        "the command substitution $(pwd) (line 8); config file $(pwd)/examples/sglang_multiturn/config/"
        "gsm8k_multiturn_grpo.yaml not found; not audited",
    ) in notes(launch)


# --- one feature per row ----------------------------------------------------------------------------------

READER_CASES = [
    pytest.param(f"{LAUNCH} a.b=1 c.d=2  # trailing comment\n", ["a.b=1", "c.d=2"], id="comment"),
    pytest.param(f"# {LAUNCH} x=1\n{LAUNCH} a.b=1\n", ["a.b=1"], id="commented-out-launch"),
    pytest.param(f"{LAUNCH} \\\n  a.b=1 \\\n  c.d=2\n", ["a.b=1", "c.d=2"], id="continuation"),
    pytest.param(f"{LAUNCH} a.b='x y' \"c.d=$(echo)\"x\n", ["a.b=x y"], id="quotes-and-subst"),
    pytest.param(
        f'V=5\nexport W="w w"\n{LAUNCH} a.b=$V c.d="$W" e.f=${{V}}\n',
        ["a.b=5", "c.d=w w", "e.f=5"],
        id="vars",
    ),
    pytest.param(
        f"{LAUNCH} a.b=${{UNSET_X:-7}} c.d=${{UNSET_Y:-$HOME}} e.f=${{UNSET_Z:-$(date)}}\n",
        ["a.b=7", "c.d=$HOME"],
        id="default",
    ),
    pytest.param(
        f'N=8\nM=4\n{LAUNCH} a.b=$((N/2)) c.d=$((N*M)) e.f=$(( (N+1)%3 )) g.h=$((-7/2)) i.j="$(($N-1))"\n',
        ["a.b=4", "c.d=32", "e.f=0", "g.h=-3", "i.j=7"],
        id="arithmetic",
    ),
    pytest.param(f"{LAUNCH} a.b=$((X*2)) c.d=1\n", ["c.d=1"], id="arithmetic-unknown"),
    pytest.param(f'cat <<< "hello $X"\n{LAUNCH} a.b=1\n', ["a.b=1"], id="here-string"),
    pytest.param(
        f"W=1\nE=\n{LAUNCH} a.b=${{W:+yes}} c.d=${{NOPE:+no}}x e.f=${{E:+no}}\n",
        ["a.b=yes", "c.d=x", "e.f="],
        id="alternative",
    ),
    pytest.param(
        f"{LAUNCH} a.b=$HOME/x c.d=$PWD/y e.f=$USER\n",
        ["a.b=$HOME/x", "c.d=$PWD/y", "e.f=$USER"],
        id="machine",
    ),
    pytest.param(
        f'CFG="a.b=1 c.d=$(date) e.f=$SOMEWHERE g.h=2"\n{LAUNCH} $CFG\n',
        ["a.b=1", "g.h=2"],
        id="keep-known-words",
    ),
    pytest.param(
        f'A=(a.b=1)\nif [ -n "$X" ]; then\n  A+=(c.d=2)\nfi\n{LAUNCH} "${{A[@]}}" e.f=3\n',
        ["a.b=1", "e.f=3"],
        id="conditional-append",
    ),
    pytest.param(
        f"A=(a.b=1)\ncase $E in\n  m) A+=(model_engine=megatron) ;;\n  *) A+=(c.d=1) ;;\nesac\n{LAUNCH} ${{A[@]}}\n",
        ["a.b=1"],
        id="case-append",
    ),
    pytest.param(f'{LAUNCH} "${{NEVER[@]}}" a.b=1\n', ["a.b=1"], id="unset-array-is-empty"),
    pytest.param(
        f'X="a.b=1"\nif [ -n "$K" ]; then\n  X="$X c.d=2 e.f=3"\nfi\n{LAUNCH} $X g.h=4\n',
        ["a.b=1", "g.h=4"],
        id="conditional-scalar-suffix",
    ),
    pytest.param(
        f"E=m\nA=(a.b=1)\ncase $E in\n  m) A+=(model_engine=megatron) ;;\n  *) A+=(c.d=1) ;;\nesac\n{LAUNCH} ${{A[@]}}\n",
        ["a.b=1", "model_engine=megatron"],
        id="case-known-subject",
    ),
    pytest.param(
        f'E=${{E:-x}}\nA=(a.b=1)\ncase "$E" in\n  m)\n    A+=(e.f=2)\n    ;;\n  n|x) A+=(c.d=1);;\nesac\n{LAUNCH} "${{A[@]}}"\n',
        ["a.b=1", "c.d=1"],
        id="case-default-and-alternatives",
    ),
    pytest.param(
        f"E=a\ncase $E in\n  b) case $E in a) {LAUNCH} no=1 ;; esac ;;\n  a) {LAUNCH} a.b=1 ;;\n  *) {LAUNCH} no=2 ;;\nesac\n",
        ["a.b=1"],
        id="case-launch-in-branch",
    ),
    pytest.param(f'ARGS="a.b=1 c.d=2"\n{LAUNCH} $ARGS e.f=3\n', ["a.b=1", "c.d=2", "e.f=3"], id="word-split"),
    pytest.param(f'ARGS="a.b=1 c.d=2"\n{LAUNCH} "$ARGS"\n', ["a.b=1 c.d=2"], id="quoted-no-split"),
    pytest.param(
        f"A=(a.b=1\n  c.d='x y')\nA+=(e.f=3)\n{LAUNCH} \"${{A[@]}}\"\n",
        ["a.b=1", "c.d=x y", "e.f=3"],
        id="arrays",
    ),
    pytest.param(
        "python -u -m verl.trainer.main_ppo a.b=1 2>&1 | tee log\n", ["a.b=1"], id="python-u-redirect"
    ),
    pytest.param(f"CUDA_VISIBLE_DEVICES=0 nohup {LAUNCH} a.b=1 > out.log &\n", ["a.b=1"], id="env-prefix"),
    pytest.param(f"cat <<EOF\n{LAUNCH} no=1\nEOF\n{LAUNCH} a.b=1\n", ["a.b=1"], id="heredoc"),
    pytest.param(f"f() {{\n  {LAUNCH} no=1\n}}\n{LAUNCH} a.b=1\n", ["a.b=1"], id="function-body"),
    pytest.param(
        f"{LAUNCH} +a.b=1 ++c.d=2 ~e.f model_engine=megatron\n",
        ["+a.b=1", "++c.d=2", "~e.f", "model_engine=megatron"],
        id="hydra-grammar",
    ),
    pytest.param(f"{LAUNCH} hydra.run.dir=/tmp/x --cfg job a.b=1\n", ["a.b=1"], id="hydra-options"),
    pytest.param("python3 verl/trainer/main_ppo.py a.b=1\n", ["a.b=1"], id="script-path"),
]


@pytest.mark.parametrize(("text", "expected"), READER_CASES)
def test_reader_features(text: str, expected: list[str]) -> None:
    assert texts(one(text)) == expected


def supplies(launch: ScriptLaunch) -> list[tuple[str, int, tuple[str, ...] | None]]:
    return [(n.kind, n.line, n.supplies) for n in launch.notes if n.unread]


UNREAD_CASES = [
    pytest.param(f"{LAUNCH} a.b=$((X*2)) c.d=1\n", [("unresolved", 1, ("a.b",))], id="value"),
    pytest.param(f"{LAUNCH} $EXTRA c.d=1\n", [("unresolved", 1, None)], id="whole-word"),
    pytest.param(f"{LAUNCH} +a.b=$(date)\n", [("unresolved", 1, ("a.b",))], id="plus"),
    pytest.param(f"{LAUNCH} hydra.run.dir=$(date)\n", [], id="hydra-setting"),
    pytest.param(
        f'A=()\nif true; then\n  A+=(x.y=1 "$Z")\nfi\n{LAUNCH} ${{A[@]}}\n',
        [("maybe", 3, ("x.y",)), ("maybe", 3, None)],
        id="maybe",
    ),
    pytest.param(f"{LAUNCH} --config-name=$(date) a.b=1\n", [("config", 1, None)], id="config-name"),
    pytest.param(
        f'X=""\nif true; then\n  X="${{X}} c.d=2"\nfi\n{LAUNCH} $X\n',
        [("maybe", 5, ("c.d",))],
        id="scalar-suffix",
    ),
    pytest.param(
        f'X=a\nif true; then\n  X="$X b"\nfi\n{LAUNCH} "$X"\n', [("unresolved", 5, None)], id="quoted-suffix"
    ),
]


@pytest.mark.parametrize(("text", "expected"), UNREAD_CASES)
def test_unread_parts_say_which_keys_they_could_set(text: str, expected: list[object]) -> None:
    assert supplies(one(text)) == expected


def test_unread_parts_know_their_position() -> None:
    launch = one(f"{LAUNCH} a.b=1 $EXTRA c.d=2\n")
    assert [(n.raw, n.position) for n in launch.notes if n.unread] == [("$EXTRA", 1)]


def test_passthrough_position_and_line() -> None:
    launch = one(f'{LAUNCH} a.b=1 \\\n  "$@" \\\n  c.d=2\n')
    assert texts(launch) == ["a.b=1", "c.d=2"]
    assert launch.passthrough is not None
    assert (launch.passthrough.position, launch.passthrough.line, launch.passthrough.raw) == (1, 2, '"$@"')


def test_several_launches_and_conditional_variables() -> None:
    text = f'N=1\nif [ -n "$X" ]; then\n  N=2\nfi\n{LAUNCH} a.b=$N c.d=1\n{LAUNCH} e.f=2\n'
    first, second = parse_script(text, "run.sh")
    assert texts(first) == ["c.d=1"]
    assert notes(first) == [
        ("unresolved", 5, "$N, which is assigned inside an if/case/loop block (line 3)"),
    ]
    assert (second.index, second.line, texts(second)) == (2, 6, ["e.f=2"])


def test_user_config_file_becomes_a_yaml_layer(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text(
        "defaults:\n  - ppo_trainer\n  - _self_\ndata:\n  train_batch_size: 8\n"
    )
    launch = one(f"{LAUNCH} --config-path={tmp_path} --config-name=mine a.b=1\n")
    assert launch.config_files == (tmp_path / "mine.yaml",)
    missing = one(f"{LAUNCH} --config-path {tmp_path} --config-name nothere a.b=1\n")
    assert missing.config_files == ()
    detail = f"Hydra finds no nothere.yaml in {tmp_path}, and stops before verl starts"
    assert notes(missing) == [("config-missing", 1, detail)]
    gone = one(f"{LAUNCH} --config-path {tmp_path}/gone --config-name mine a.b=1\n")
    assert notes(gone) == [
        (
            "config-missing",
            1,
            f"Hydra finds no config directory {tmp_path}/gone, and stops before verl starts",
        )
    ]


def test_user_config_inheriting_megatron_selects_the_megatron_engine(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_megatron_trainer\n  - _self_\n")
    launch = one(f"{LAUNCH} --config-path={tmp_path} --config-name=mine a.b=1\n")
    assert launch.config_files == (tmp_path / "mine.yaml",)
    assert (launch.config_name, texts(launch)) == ("ppo_megatron_trainer", ["a.b=1"])
    assert supplies(launch) == []


def test_user_config_with_other_defaults_is_not_verified(tmp_path: Path) -> None:
    (tmp_path / "mine.yaml").write_text("defaults:\n  - ppo_trainer\n  - override actor: x\n  - _self_\n")
    (tmp_path / "other.yaml").write_text("defaults:\n  - my_base\n")
    for name in ("mine", "other"):
        launch = one(f"{LAUNCH} --config-path={tmp_path} --config-name={name} a.b=1\n")
        assert supplies(launch) == [("config", 1, None)]


# --- errors: compact, exact ------------------------------------------------------------------------------

ERRORS = [
    (
        "unterminated.sh",
        f"{LAUNCH} a.b='x\n",
        "error: cannot read {p}: unterminated single quote\n  where: {p}:1",
    ),
    ("nolaunch.sh", "echo hello\n", "error: no 'python -m verl.trainer.main_ppo' launch found in {p}"),
    ("binary.sh", b"\xff\xfe\x00", "error: {p} is not a text file (byte 0 is not UTF-8)"),
]


@pytest.mark.parametrize(("name", "content", "expected"), ERRORS)
def test_read_errors(tmp_path: Path, name: str, content: str | bytes, expected: str) -> None:
    path = tmp_path / name
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(InputError) as caught:
        read_script(path)
    assert caught.value.render().startswith(expected.format(p=path))


def test_missing_script(tmp_path: Path) -> None:
    with pytest.raises(InputError) as caught:
        read_script(tmp_path / "nope.sh")
    assert caught.value.render() == (
        f"error: script not found: {tmp_path / 'nope.sh'}\n  fix: check the path of the launch script"
    )


# --- properties ------------------------------------------------------------------------------------------

KEYS = st.from_regex(r"[a-z][a-z_]{0,8}(\.[a-z][a-z_0-9]{0,8}){1,3}", fullmatch=True)
VALUES = st.one_of(
    st.integers(-5, 5000).map(str),
    st.sampled_from(["True", "false", "null", "1e-6", "0.6", "vllm", "Qwen/Qwen2.5-7B", "a b", "x'y", 'q"r']),
    st.text(alphabet="abcXYZ019_-./,:@ ", min_size=0, max_size=12),
)
LAYOUT = st.tuples(st.sampled_from(["plain", "single", "double", "value-only", "var"]), st.booleans())


def _render(key: str, value: str, style: str, index: int) -> tuple[str, str]:
    """Shell text for one override and any assignment it needs."""
    if style == "plain" and all(c.isalnum() or c in "_-./,:@" for c in value):
        return f"{key}={value}", ""
    if style == "double" or style == "var":
        escaped = value.replace("\\", "\\\\").replace('"', '\\"').replace("$", "\\$").replace("`", "\\`")
        if style == "var":
            return f'{key}="$V{index}"', f'V{index}="{escaped}"\n'
        return f'"{key}={escaped}"', ""
    if style == "value-only":
        return f"{key}={shlex.quote(value)}", ""
    return shlex.quote(f"{key}={value}"), ""


@settings(max_examples=examples(60), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(KEYS, VALUES, LAYOUT), min_size=1, max_size=8), st.booleans())
def test_layouts_give_the_same_overrides(items: list[tuple[str, str, tuple[str, bool]]], tail: bool) -> None:
    words: list[str] = []
    prelude = ""
    for index, (key, value, (style, newline)) in enumerate(items):
        word, assign = _render(key, value, style, index)
        prelude += assign
        words.append(word + (" \\\n    " if newline else " "))
    passthrough = '"$@"' if tail else ""
    text = f"{prelude}# launch\n{LAUNCH} {''.join(words)}{passthrough}\n"
    launch = one(text)
    assert texts(launch) == [f"{k}={v}" for k, v, _ in items]
    assert (launch.passthrough is not None) == tail


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=300))
def test_random_bytes_never_traceback(tmp_path_factory: pytest.TempPathFactory, data: bytes) -> None:
    path = tmp_path_factory.mktemp("bytes") / "x.sh"
    path.write_bytes(data)
    try:
        read_script(path)
    except InputError as exc:
        assert exc.render().startswith("error: ")


@settings(max_examples=examples(200), deadline=None)
@given(st.text(alphabet="ab=$@'\"\\{}()[]#;&|<>`\n -.:", max_size=120))
def test_random_shell_text_never_traceback(text: str) -> None:
    try:
        parse_script(f"{LAUNCH} {text}\n{text}\n{LAUNCH} {text}", "x.sh")
    except InputError as exc:
        assert exc.render().startswith("error: cannot read x.sh: ")
