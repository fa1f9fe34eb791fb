"""`submit --help` and `plan --help` read section by section: every option has a one-line help,
shows its default and belongs to a section; the sections come in order and each fits a screen."""

from __future__ import annotations

import click
import pytest
from click.testing import CliRunner

from batchrun.cli import main
from batchrun.cli.options import (
    ENGINE,
    INPUT,
    KERNELS,
    OUTPUT,
    PROGRESS,
    SAMPLING,
    STRUCTURED,
    TASK,
    THINKING,
)
from batchrun.cli.sections import OTHER, section_of

SECTIONS = {
    "submit": [
        INPUT,
        SAMPLING,
        STRUCTURED,
        THINKING,
        ENGINE,
        KERNELS,
        TASK,
        OUTPUT,
        PROGRESS,
        OTHER,
    ],
    "plan": [INPUT, SAMPLING, ENGINE, OUTPUT, OTHER],
}
SCREEN = 40  # lines


def options(name: str) -> list[click.Option]:
    command = main.commands[name]
    ctx = click.Context(command, info_name=name, **command.context_settings)
    return [p for p in command.get_params(ctx) if isinstance(p, click.Option)], ctx


def help_sections(name: str, width: int) -> dict[str, list[str]]:
    """Section heading -> its lines, from `batchrun NAME --help` at `width` columns."""
    result = CliRunner().invoke(main, [name, "--help"], terminal_width=width)
    assert result.exit_code == 0, result.output
    sections: dict[str, list[str]] = {}
    current = None
    for line in result.output.splitlines():
        if line.endswith(":") and not line.startswith(" "):
            current = line[:-1]
            sections[current] = []
        elif current is not None and line.strip():
            sections[current].append(line)
    return sections


@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_every_option_has_help_a_default_and_a_section(name):
    params, ctx = options(name)
    for param in params:
        label = "/".join(param.opts)
        if "--help" in param.opts:
            assert section_of(param) is None
            continue
        assert section_of(param) in SECTIONS[name], f"{label} is in no section"
        assert param.help and param.help.strip(), f"{label} has no help"
        assert "\n" not in param.help.strip(), f"{label}: help is one line"
        _, record = param.get_help_record(ctx)
        if not param.is_flag or param.secondary_opts:
            assert param.required or "default: " in record, f"{label} shows no default"


@pytest.mark.parametrize("name", sorted(SECTIONS))
@pytest.mark.parametrize("width", [80, 100])
def test_sections_in_order_each_a_screen(name, width):
    sections = help_sections(name, width)
    assert list(sections) == SECTIONS[name]
    for section, lines in sections.items():
        assert len(lines) <= SCREEN, f"{section}: {len(lines)} lines at {width} columns"
