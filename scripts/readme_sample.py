"""README.md's sample output, made by running the README's own example command.

    python scripts/readme_sample.py            # run the example, print the sample block
    python scripts/readme_sample.py --write    # ... and put it into README.md
    python scripts/readme_sample.py --check    # ... and exit 1 when README.md's block differs

The block sits between the README's `<!-- sample:begin -->` and `<!-- sample:end -->` lines: three
result lines (by id, since the file's line order follows the order rows finish) and the output
of `batchrun inspect` on the run. The command is read from the README's "Two commands" line, so
the sample is what that line produces; the run goes to a temporary directory, shown as the
command's `--out`. `--check` compares everything but the run's timestamps (tests/e2e/
test_readme_sample.py runs it).
"""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
BEGIN, END = "<!-- sample:begin -->", "<!-- sample:end -->"
SAMPLE_IDS = ("chat-concise", "chat-followup", "w-haiku")
# where the manifest's absolute input path shows the checkout
CHECKOUT = "/path/to/batchrun"
_TIMES = re.compile(r"\(created [^,)]+(, finished [^)]+)?\)")


def example_args(readme: str) -> list[str]:
    """The arguments of the README's `.venv/bin/batchrun submit ...` command."""
    for line in readme.splitlines():
        if ".venv/bin/batchrun submit" in line:
            words = shlex.split(line.split(".venv/bin/batchrun", 1)[1])
            return words
    raise SystemExit("README.md has no `.venv/bin/batchrun submit` command")


def run_example(args: list[str], tmp: Path) -> tuple[Path, str]:
    """Run the example with its --out in `tmp`; (the run directory, the --out the README names)."""
    i = args.index("--out")
    shown, out = args[i + 1], tmp / "example"
    argv = [*args[:i], "--out", str(out), *args[i + 2 :], "--quiet"]
    cmd = [sys.executable, "-m", "batchrun", *argv]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return out, shown


def render(out: Path, shown: str) -> str:
    """The sample block for the run in `out`, paths shown as the README's command names them."""
    records = {}
    for line in (out / "results-00000.jsonl").read_text().splitlines():
        rid = re.match(r'\{"id":"([^"]*)"', line)
        if rid and rid.group(1) in SAMPLE_IDS:
            records[rid.group(1)] = line
    missing = [r for r in SAMPLE_IDS if r not in records]
    if missing:
        raise SystemExit(f"the run has no result for {missing}")
    inspect = subprocess.run(
        [sys.executable, "-m", "batchrun", "inspect", str(out)],
        cwd=ROOT,
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    inspect = inspect.replace(str(out), shown).replace(str(ROOT), CHECKOUT)
    return "\n".join(
        [
            BEGIN,
            f"Real output from the example (`{shown}/results-00000.jsonl`, three of its lines):",
            "",
            "```json",
            *(records[r] for r in SAMPLE_IDS),
            "```",
            "",
            "(A 135M-parameter model quantized to 4 bits: fine for a demo, not for answers. "
            "`cached_tokens`",
            "24 is the chat template's shared system prompt, computed once and served from the "
            "prefix cache.)",
            "",
            "```",
            f"$ .venv/bin/batchrun inspect {shown}",
            inspect.rstrip("\n"),
            "```",
            END,
        ]
    )


def current_block(readme: str) -> str:
    start, end = readme.find(BEGIN), readme.find(END)
    if start < 0 or end < start:
        raise SystemExit(f"README.md has no {BEGIN} ... {END} block")
    return readme[start : end + len(END)]


def without_times(block: str) -> str:
    return _TIMES.sub("(created ..., finished ...)", block)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--write", action="store_true", help="put the block into README.md")
    mode.add_argument("--check", action="store_true", help="exit 1 if README.md's block differs")
    a = p.parse_args(argv)
    readme = README.read_text()
    old = current_block(readme)
    with tempfile.TemporaryDirectory() as tmp:
        block = render(*run_example(example_args(readme), Path(tmp)))
    if a.write:
        README.write_text(readme.replace(old, block))
    elif a.check:
        if without_times(old) != without_times(block):
            print("README.md's sample output differs from the example's run:", file=sys.stderr)
            print(block, file=sys.stderr)
            print("run `python scripts/readme_sample.py --write`", file=sys.stderr)
            return 1
    else:
        print(block)
    return 0


if __name__ == "__main__":
    sys.exit(main())
