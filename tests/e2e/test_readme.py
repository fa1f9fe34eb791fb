"""README.md's code, run or checked.

- Every ```python block runs on the CPU, on the embedded SmolLM2-135M, with the substitutions
  listed in PYTHON_BLOCKS (each must still match the README's text; a new block must be listed
  there or in PYTHON_NOT_RUN with the reason).
- Every `batchrun ...` command line of the README (indented blocks, `$ ` lines) names a real
  command and real options of it; every `--option` the README mentions is one of some command.
- The cheap and safe commands in SHELL_RUN run: the example `submit` (fewer rows and tokens)
  and `inspect` of its output. The others (SHELL_NOT_RUN) say why not.
- The ```json blocks (sample records) parse; the bare ``` block of `inspect` output is sample
  output, not checked.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import click
import pytest
from click.testing import CliRunner

from batchrun.cli import main

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"


class Block(NamedTuple):
    section: str  # the heading above the block
    lang: str  # the fence's language ("" for a bare fence), or "indented"
    text: str


def readme_blocks() -> list[Block]:
    """The README's code blocks: fenced ones and 4-space indented ones."""
    blocks: list[Block] = []
    section, fence, lines, indented = "", None, [], []
    prev_blank = True
    for line in README.read_text().splitlines():
        if fence is not None:
            if line.startswith("```"):
                blocks.append(Block(section, fence, "\n".join(lines) + "\n"))
                fence, lines = None, []
            else:
                lines.append(line)
            continue
        if indented and not line.startswith("    "):
            blocks.append(Block(section, "indented", "\n".join(indented) + "\n"))
            indented = []
        if line.startswith("```"):
            fence = line[3:].strip()
        elif line.startswith("#"):
            section = line.lstrip("#").strip()
        elif line.startswith("    ") and (indented or prev_blank):
            indented.append(line[4:])
        prev_blank = not line.strip()
    if indented:
        blocks.append(Block(section, "indented", "\n".join(indented) + "\n"))
    return blocks


# -- python blocks ---------------------------------------------------------------------------

# section -> (README text, what the test runs instead): the model and device of the example
# become the embedded model on the CPU, and its completions short
PYTHON_BLOCKS = {
    "Python API": [
        ('EngineConfig(model="~/models/Llama-3.1-8B-Instruct", device="cuda")',
         'EngineConfig(model=None, device="cpu")'),
        ("max_new_tokens=256", "max_new_tokens=8"),
    ],
}  # fmt: skip
PYTHON_NOT_RUN: dict[str, str] = {}  # section -> why its python block does not run here


def python_blocks() -> list[Block]:
    return [b for b in readme_blocks() if b.lang == "python"]


def test_every_python_block_is_run_or_says_why_not():
    sections = [b.section for b in python_blocks()]
    assert len(sections) == len(set(sections)), "one python block per section (see PYTHON_BLOCKS)"
    assert set(sections) == set(PYTHON_BLOCKS) | set(PYTHON_NOT_RUN)


@pytest.mark.parametrize("section", sorted(PYTHON_BLOCKS))
def test_python_block_runs(section, tmp_path):
    (block,) = [b for b in python_blocks() if b.section == section]
    code = block.text
    for old, new in PYTHON_BLOCKS[section]:
        assert old in code, f"README's {section!r} block no longer holds {old!r}: update the test"
        code = code.replace(old, new)
    script = tmp_path / "block.py"
    script.write_text(code)
    env = dict(os.environ)  # the installed batchrun (the checkout's kernels/ shadows a package)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    if section == "Python API":
        # each print starts "rid finish_reason text..." (the text may hold newlines)
        starts = re.findall(r"^([01]) (stop|length) ", done.stdout, flags=re.M)
        assert sorted(rid for rid, _ in starts) == ["0", "1"], done.stdout


def test_json_blocks_parse():
    """The ```json blocks (records as the output files hold them) are JSON lines."""
    blocks = [b for b in readme_blocks() if b.lang == "json"]
    assert blocks
    for b in blocks:
        for line in b.text.splitlines():
            assert isinstance(json.loads(line), dict), line


# -- shell commands --------------------------------------------------------------------------

# README command (its first words) -> substitutions; the run goes to a temporary directory
SHELL_RUN = {
    ".venv/bin/batchrun submit examples/prompts.jsonl": [
        (".venv/bin/batchrun", "batchrun"),
        ("--out runs/example", "--out {out}"),
        ("--max-tokens 128", "--max-tokens 8 --limit 4 --device cpu --quiet"),
    ],
    ".venv/bin/batchrun inspect runs/example": [
        (".venv/bin/batchrun", "batchrun"),
        ("runs/example", "{out}"),
    ],
}
SHELL_NOT_RUN = {
    "bash scripts/setup-env.sh": "installs packages into .venv",
    "bash scripts/test.sh": "runs this test suite",
    "pip install": "installs packages",
    "batchrun submit prompts.parquet": "needs a Llama-3.1-8B directory and a prompts.parquet",
    "batchrun submit data.parquet": "needs a dataset and a model (and --device cuda a GPU)",
    "batchrun tail": "needs a run serving progress (tests/e2e/test_progress_server.py)",
    "batchrun export runs/exp": "needs a run (tests/e2e/test_inputs_export.py exports runs)",
    "batchrun serve": "starts a server (tests/e2e/test_serve.py runs one)",
    "batchrun submit passages.parquet": "needs an embedding model (tests/e2e/test_pooling_job.py "
    "runs embed, score, rerank and classify jobs on tiny ones)",
    "--task score": "needs a cross-encoder (tests/e2e/test_pooling_job.py)",
    "--task rerank": "needs a cross-encoder (tests/e2e/test_pooling_job.py)",
    "--task classify": "needs a reward model (tests/e2e/test_pooling_job.py classifies)",
    "batchrun export runs/emb": "needs an embed run (tests/e2e/test_pooling_job.py exports one)",
}
# options of other programs that the README mentions
OTHER_OPTIONS = {"--no-deps", "--signal"}


def shell_lines() -> list[str]:
    """Every command line of the README: indented blocks, and `$ ` lines in bare fences."""
    out = []
    for b in readme_blocks():
        for line in b.text.splitlines():
            if b.lang == "indented" and line.strip():
                out.append(line.strip())
            elif b.lang == "" and line.startswith("$ "):
                out.append(line[2:].strip())
    return out


def batchrun_calls(line: str) -> list[list[str]]:
    """The `batchrun` invocations of a shell line (`a && b` splits), as argument lists."""
    calls = []
    for part in line.split("&&"):
        words = shlex.split(part, comments=True)
        if words and Path(words[0]).name == "batchrun":
            calls.append(words[1:])
    return calls


def options_of(command: click.Command) -> set[str]:
    ctx = click.Context(command)
    return {o for p in command.get_params(ctx) for o in (*p.opts, *p.secondary_opts)}


def test_readme_commands_name_real_commands_and_options():
    calls = [c for line in shell_lines() for c in batchrun_calls(line)]
    assert len(calls) >= 5, calls  # the parser still finds the README's commands
    for args in calls:
        name = args[0]
        assert name in main.commands, f"README runs `batchrun {name}`: no such command"
        known = options_of(main.commands[name])
        for word in args[1:]:
            if word.startswith("-"):
                assert word.split("=")[0] in known, f"`batchrun {name}` has no option {word}"


def test_every_option_the_readme_mentions_exists():
    known = set(OTHER_OPTIONS)
    for command in (main, *main.commands.values()):
        known |= options_of(command)
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", README.read_text()))
    assert mentioned - known == set()


# the pages of docs/ a user reads beside the README (benchmarks.md names the scripts' options)
DOCS = ("guide.md", "models.md", "formats.md", "kernels.md")


def test_every_option_the_docs_mention_exists():
    known = set(OTHER_OPTIONS)
    for command in (main, *main.commands.values()):
        known |= options_of(command)
    for name in DOCS:
        text = (REPO / "docs" / name).read_text()
        mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", text))
        assert mentioned - known == set(), name


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_between_the_pages_resolve():
    """Every relative link of README.md and docs/*.md names a file that exists and, with a
    #fragment, a heading of that file."""
    pages = [README, *sorted((REPO / "docs").glob("*.md"))]
    for page in pages:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"[a-z]+:", target):
                continue  # https:, mailto:
            path, _, fragment = target.partition("#")
            linked = (page.parent / path).resolve() if path else page
            assert linked.exists(), f"{page.name}: link to {target}: no such file"
            if fragment:
                headings = re.findall(r"^#+ (.+)$", linked.read_text(), flags=re.M)
                assert fragment in {slug(h) for h in headings}, f"{page.name}: {target}"


def test_every_command_line_is_run_or_says_why_not():
    for line in shell_lines():
        keys = [k for k in (*SHELL_RUN, *SHELL_NOT_RUN) if k in line]
        assert keys, f"README command {line!r}: add it to SHELL_RUN or SHELL_NOT_RUN"
    text = README.read_text()
    for key in (*SHELL_RUN, *SHELL_NOT_RUN):
        assert key in text, f"{key!r} is no longer in README.md: update the test"


def test_example_commands_run(tmp_path, monkeypatch):
    """`batchrun submit examples/prompts.jsonl ...` (4 rows, 8 tokens) and `batchrun inspect`."""
    monkeypatch.chdir(REPO)  # the README's paths are relative to the checkout
    out = tmp_path / "example"
    for key, substitutions in SHELL_RUN.items():
        (line,) = [x for x in shell_lines() if key in x]
        line = line[line.index(key) :]  # from the batchrun call on (after `setup-env.sh &&`)
        for old, new in substitutions:
            assert old in line, f"README's {key!r} no longer holds {old!r}: update the test"
            line = line.replace(old, new.format(out=out))
        (args,) = batchrun_calls(line)
        result = CliRunner().invoke(main, args, catch_exceptions=False)
        assert result.exit_code == 0, result.output
    assert "status       complete" in result.output
    assert "rows         4: 4 ok" in result.output


def test_help_runs():
    for args in ([], *([name] for name in main.commands)):
        result = CliRunner().invoke(main, [*args, "--help"])
        assert result.exit_code == 0, result.output
        assert "Usage: " in result.output
