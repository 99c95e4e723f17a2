"""What README.md and docs/*.md show holds: links and images resolve, every `aiayn NAME`, `python -m
train.*` or `parity.*` command in a code block is accepted by its CLI's parser (a dry parse, no work),
every recipe loads, and the README stays a short entry page."""

import importlib
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from urllib.parse import unquote

import pytest

from train.commands import COMMANDS as AIAYN
from train.commands import run

REPO = Path(__file__).resolve().parents[1]
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
FENCED = re.compile(r"^[ \t]*```.*?^[ \t]*```", re.M | re.S)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"\[[^\]]*\]\(\s*<?([^)\s>]+)")  # [text](target "title") and ![alt](target)
OPERATORS = set("|&;<>()")  # a shell token made of these ends a command
# `aiayn NAME` or `python -m train.X` / `parity.X` where a shell command starts: a line's start (after
# VAR=value settings) or after |, &&, ;, (.
COMMAND = re.compile(r"(?:^|[|&;(])\s*(?:\w+=\S*\s+)*(?:python3? -m ((?:train|parity)[\w.]*)|aiayn ([\w-]+))")


def _commands(doc: Path):
    """(where, module, argv) of each `aiayn NAME ...` or `python -m train.X|parity.X ...` in the fenced
    code blocks of `doc` (an `aiayn` name by its module): lines continued with a backslash joined,
    comments and what follows |, &&, ;, < or > left out; placeholders (RUN, FILE) stay as they are,
    and `...` (flags left out) is dropped."""
    text = doc.read_text(encoding="utf-8")
    for block in FENCED.finditer(text):
        line_number = text.count("\n", 0, block.start()) + 1
        for line in re.split(r"(?<!\\)\n", block.group()):  # a line ending in \ goes on
            where, line_number = f"{doc.name}:{line_number}", line_number + line.count("\n") + 1
            line = re.sub(r"(^|\s)#.*", "", line.replace("\\\n", " "))  # comments out
            for command in COMMAND.finditer(line):
                lexer = shlex.shlex(line[command.end():], posix=True, punctuation_chars=True)
                lexer.whitespace_split, lexer.commenters = True, ""
                argv = []
                try:
                    for word in lexer:
                        if word and set(word) <= OPERATORS:  # "" is an argument (--test ""), not an operator
                            break
                        argv += [] if word == "..." else [word]
                except ValueError as err:  # an unclosed quote: reported by the test, not at collection
                    yield where, None, [str(err), line]
                    continue
                module = command[1] or AIAYN.get(command[2], (None,))[0]
                yield where, module, argv if module else [f"no command aiayn {command[2]}", line]


COMMANDS = [command for doc in DOCS for command in _commands(doc)]


@pytest.mark.parametrize("where, module, argv", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_documented_command_parses(where, module, argv, monkeypatch, capsys):
    assert module, f"{where}: {argv}"
    monkeypatch.chdir(REPO)  # recipes and data are named relative to the repository root
    try:
        if module in ("train.run", "train.commands.run"):
            run.parse_config(argv)  # with --config, the recipe is loaded too
        else:
            importlib.import_module(module).build_parser().parse_args(argv)
    except SystemExit as exit_:
        assert exit_.code == 0, f"{where}: python -m {module} {shlex.join(argv)}\n{capsys.readouterr().err}"


def test_documented_commands_found():
    modules = {module for _, module, _ in COMMANDS}
    assert {"train.run", "train.commands.evaluate", "train.commands.average"} <= modules, modules


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_links_resolve(doc):
    text = INLINE_CODE.sub("", FENCED.sub("", doc.read_text(encoding="utf-8")))
    missing = []
    for target in LINK.findall(text):
        path = unquote(target.partition("#")[0])
        if path and ":" not in path and not (doc.parent / path).exists():  # ':': a URL (https:, mailto:)
            missing.append(target)
    assert not missing, f"{doc.name}: links to missing files: {missing}"


def test_every_recipe_loads(monkeypatch):
    monkeypatch.chdir(REPO)
    recipes = sorted((REPO / "recipes").glob("*.toml"))
    assert recipes
    for recipe in recipes:
        assert run.parse_config(["--config", str(recipe)])[0].recipe == str(recipe)


def test_readme_is_short():
    lines = len((REPO / "README.md").read_text(encoding="utf-8").splitlines())
    assert lines <= 200, f"README.md has {lines} lines; the details belong in docs/"


PYTHON_BLOCK = re.compile(r"^```python\n(.*?)^```", re.M | re.S)


def _python_blocks(doc: Path) -> list[str]:
    return PYTHON_BLOCK.findall(doc.read_text(encoding="utf-8"))


def test_readme_python_block_is_on_the_python_page():
    """The README shows the API in at most 10 lines, each of which docs/python.md runs."""
    (block,) = _python_blocks(REPO / "README.md")
    assert len(block.splitlines()) <= 10
    page = "".join(_python_blocks(REPO / "docs" / "python.md"))
    for line in block.splitlines():
        assert line.split("#")[0].strip() in page, line


def test_python_page_runs(tmp_path):
    """docs/python.md's blocks, in order, as one script in a fresh interpreter beside the recipes: the
    numbers model trains, translates 43 right, refuses a second run in its directory and averages."""
    blocks = _python_blocks(REPO / "docs" / "python.md")
    assert len(blocks) >= 5
    (tmp_path / "recipes").symlink_to(REPO / "recipes")
    # This checkout's train, not another that the interpreter's installation points at.
    result = subprocess.run([sys.executable, "-c", "\n".join(blocks)], cwd=tmp_path, capture_output=True,
                            text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "['forty-three', 'seven hundred and twelve']" in out  # the translation the page shows
    assert "already holds a run; pass resume" in out  # from Python: the parameter, not the flag
    assert "averaged_steps" in out and "torch.Size([1, 3, 100]) (1, 3, 100)" in out
