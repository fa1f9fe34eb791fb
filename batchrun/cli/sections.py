"""Options filed under sections, so `--help` reads one screen per section.

    sampling_options = option_group("Sampling", click.option("--max-tokens", ...), ...)

    @main.command(cls=SectionedCommand)
    @sampling_options
    def submit(...): ...

An option belongs to the section of the innermost group that lists it (a group may list
another group); `--help` prints the sections in the order their first option appears, and
options outside every section (the help option) last, under OTHER.
"""

from __future__ import annotations

import click

OTHER = "Other options"


def option_group(section: str, *options):
    """One decorator that applies `options` as if they were stacked in the order listed, and
    files each option it adds under `section` (unless an inner group filed it already)."""

    def apply(f):
        for opt in reversed(options):
            before = len(getattr(f, "__click_params__", ()))
            f = opt(f)
            for param in f.__click_params__[before:]:
                if section_of(param) is None:
                    param.help_section = section
        return f

    return apply


def section_of(param: click.Parameter) -> str | None:
    return getattr(param, "help_section", None)


class SectionedCommand(click.Command):
    """A command whose --help lists its options section by section, each with its default."""

    def __init__(self, *args, **kwargs):
        kwargs["context_settings"] = {"show_default": True, **kwargs.get("context_settings", {})}
        super().__init__(*args, **kwargs)

    def sections(self, ctx: click.Context) -> dict[str, list[click.Parameter]]:
        """Section name -> its options, in --help order (OTHER last)."""
        out: dict[str, list[click.Parameter]] = {}
        other = []
        for param in self.get_params(ctx):
            if isinstance(param, click.Argument):
                continue
            name = section_of(param)
            if name is None:
                other.append(param)
            else:
                out.setdefault(name, []).append(param)
        if other:
            out[OTHER] = other
        return out

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        for name, params in self.sections(ctx).items():
            records = [r for p in params if (r := p.get_help_record(ctx)) is not None]
            if records:
                with formatter.section(name):
                    formatter.write_dl(records)
