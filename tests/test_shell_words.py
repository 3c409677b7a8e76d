"""The bash lexer against bash itself: the words it finds are the arguments bash passes, quoting and all."""

from __future__ import annotations

import subprocess

import pytest

from verl_safe_launch.shell.words import ArrayAssign, Op, PartKind, ShellSyntaxError, Word, lex


def bash_args(command: str) -> list[str]:
    """The arguments bash passes to a command: ``printf '<%s>\\n' WORDS`` run by a clean ``bash``."""
    done = subprocess.run(
        ["bash", "--norc", "--noprofile", "-c", f"printf '<%s>\\n' {command}"],
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin"},
        check=True,
    )
    out = done.stdout
    assert out.startswith("<") and out.endswith(">\n"), out
    return out[1:-2].split(">\n<")


def literal_words(command: str) -> list[str]:
    """Our words of a command without expansions: each word's parts joined."""
    words = [t for t in lex(command) if isinstance(t, Word)]
    assert all(p.kind is PartKind.LIT for w in words for p in w.parts)
    return ["".join(p.text for p in w.parts) for w in words]


LITERAL = [
    "a b   c",
    "'single quoted' \"double quoted\"",
    "key=\"a b\"'c d'e",
    "escaped\\ space back\\\\slash \\'q\\\"",
    '"inside \\"dq\\" \\\\ \\$ \\` and \\n kept"',
    "'no \\escape in single' ''",
    '""',
    "line\\\ncontinued next",
    "x=1 # a comment 'not closed",
    "'multi\nline' after",
    "a'b'\"c\"d",
    "unicode-é '☃'",
]


@pytest.mark.parametrize("command", LITERAL)
def test_literal_words_match_bash(command: str) -> None:
    expected = bash_args(command)
    assert expected, command
    assert literal_words(command) == expected


def test_expansions_are_parts_with_their_quoting() -> None:
    [word] = [t for t in lex('pre"$A-${B:-def x}"${C[@]}$@$(cmd "a b")`tick`$1$') if isinstance(t, Word)]
    kinds = [(p.kind, p.text, p.quoted) for p in word.parts]
    assert kinds == [
        (PartKind.LIT, "pre", False),
        (PartKind.VAR, "A", True),
        (PartKind.LIT, "-", True),
        (PartKind.VAR, "B", True),
        (PartKind.ARRAY, "C", False),
        (PartKind.ARGS, "@", False),
        (PartKind.SUBST, '$(cmd "a b")', False),
        (PartKind.SUBST, "`tick`", False),
        (PartKind.VAR, "1", False),
        (PartKind.LIT, "$", False),
    ]
    default = word.parts[3].default
    assert default is not None
    assert [(p.kind, p.text) for p in default] == [(PartKind.LIT, "def x")]  # one word inside double quotes


def test_operators_lines_and_raw_text() -> None:
    tokens = lex("a && b || c; d | e &\nf > out 2>&1\n\ng \\\n  h")
    ops = [t.text for t in tokens if isinstance(t, Op)]
    assert ops == ["&&", "||", ";", "|", "&", "\n", ">", ">&", "\n", "\n"]
    words = {t.raw: t.line for t in tokens if isinstance(t, Word)}
    assert words == {"a": 1, "b": 1, "c": 1, "d": 1, "e": 1, "f": 2, "out": 2, "1": 2, "g": 4, "h": 5}


def test_array_assignment_and_function() -> None:
    tokens = lex("ARGS=(\n  one 'two three' # comment\n  four\n)\nARGS+=(five)\nrun() { :; }")
    arrays = [t for t in tokens if isinstance(t, ArrayAssign)]
    assert [(a.name, a.append, a.line) for a in arrays] == [("ARGS", False, 1), ("ARGS", True, 5)]
    assert [w.raw for w in arrays[0].items] == ["one", "'two three'", "four"]
    assert [w.line for w in arrays[0].items] == [2, 2, 3]
    assert Op("()", 6) in tokens
    assert bash_args("\"${ARGS[@]}\"; ARGS=(one 'two three' four); printf '<%s>\\n' \"${ARGS[@]}\"")[1:] == [
        "one",
        "two three",
        "four",
    ]


def test_heredoc_body_is_skipped_and_lines_counted() -> None:
    tokens = lex("cat <<'EOF'\nnot $(a) word\nEOF\nafter\ncat <<-END\n\tbody\n\tEND\nlast")
    words = [(t.raw, t.line) for t in tokens if isinstance(t, Word)]
    assert words == [("cat", 1), ("after", 4), ("cat", 5), ("last", 8)]


@pytest.mark.parametrize(
    ("text", "message", "line"),
    [
        ("ok\necho 'open", "unterminated single quote", 2),
        ('echo "open\nmore', "unterminated double quote", 1),
        ("echo $(open", "unterminated $( ... )", 1),
        ("echo ${open", "unterminated ${ ... }", 1),
        ("echo `open", "unterminated backquote", 1),
        ("A=(one\ntwo", "unterminated array ( ... )", 1),
    ],
)
def test_syntax_errors_bash_also_refuses(text: str, message: str, line: int) -> None:
    with pytest.raises(ShellSyntaxError) as info:
        lex(text)
    assert (info.value.message, info.value.line) == (message, line)
    assert subprocess.run(["bash", "-n", "-c", text], capture_output=True).returncode != 0
