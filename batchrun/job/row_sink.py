"""Where a finished row goes: its completions become records (plain or OpenAI Batch output lines,
or an error line), the records go into the run's output files, and the row is counted in the
run's summary, on the progress bar and on the progress hub."""

from __future__ import annotations

from typing import TYPE_CHECKING

from batchrun.chat.parsers import OutputParser, ParserChoice, resolve_parsers
from batchrun.engine.stop import cut_at_stop
from batchrun.errors import RunError
from batchrun.io.records import (
    Completion,
    encode_line,
    error_record,
    logprob_token_ids,
    openai_error_record,
    openai_result_record,
    result_records,
)
from batchrun.io.rows import PreparedRow, RowError
from batchrun.job.commit import RunOutput
from batchrun.job.config import RunConfig
from batchrun.job.summary import RunSummary
from batchrun.job.token_text import TokenTexts
from batchrun.params import GenerateResult
from batchrun.progress.bar import Progress

if TYPE_CHECKING:
    from batchrun.progress.hub import ProgressHub


class RowSink:
    def __init__(
        self,
        config: RunConfig,
        output: RunOutput,
        summary: RunSummary,
        tokenizer,
        hub: ProgressHub | None,
    ):
        self.config = config
        self.output = output
        self.summary = summary
        self.tokenizer = tokenizer
        self.hub = hub
        self.progress = Progress(None, quiet=True)  # the runner's bar once the run starts
        self._token_texts = TokenTexts(tokenizer)
        try:
            choice = resolve_parsers(tokenizer, config.reasoning_parser, config.tool_call_parser)
        except ValueError as e:
            raise RunError(str(e)) from e
        self.parser = OutputParser(tokenizer, choice)
        # OpenAI /v1/completions rows: the whole output is the text, as the OpenAI-compatible
        # servers write it (they parse reasoning and tool calls on the chat endpoint only)
        self._text_parser = OutputParser(tokenizer, ParserChoice(None, None))

    def completion(self, prepared: PreparedRow, r: GenerateResult) -> Completion:
        """One finished sample, its text decoded (and cut at the stop string it matched), its
        reasoning and tool calls apart (batchrun/chat/)."""
        text_completion = prepared.openai and prepared.extra.get("url") == "/v1/completions"
        parser = self._text_parser if text_completion else self.parser
        parsed = parser.parse(
            r.output_ids,
            prepared.thinking_open,
            f"{prepared.id}\0{r.index}",
            with_tools=self._has_tools(prepared),
        )
        text = parsed.text
        if r.finish_reason == "stop" and isinstance(r.matched_stop, str):
            text = cut_at_stop(text, prepared.params.stop, matched=r.matched_stop)
        finish = r.finish_reason
        if parsed.tool_calls and finish == "stop":
            finish = "tool_calls"
        return Completion(
            index=r.index,
            text=text,
            token_ids=r.output_ids,
            finish_reason=finish,
            prompt_tokens=r.prompt_tokens,
            completion_tokens=r.completion_tokens,
            cached_tokens=r.cached_tokens,
            logprobs=r.logprobs,
            top_logprobs=r.top_logprobs,
            reasoning=parsed.reasoning,
            tool_calls=parsed.tool_calls,
            warning=parsed.warning,
        )

    def _has_tools(self, prepared: PreparedRow) -> bool:
        """Whether the row's template got tools (its own, or --chat-template-kwargs')."""
        spec_kwargs = self.config.spec.chat_template_kwargs or {}
        return "tools" in {**spec_kwargs, **(prepared.template_kwargs or {})}

    def results(self, prepared: PreparedRow, done: list[Completion]) -> None:
        """A row whose n samples all finished: its result lines."""
        s = self.summary
        s.rows += 1
        s.rows_ok += 1
        s.completions += len(done)
        s.prompt_tokens += sum(c.prompt_tokens for c in done)
        s.cached_tokens += sum(c.cached_tokens for c in done)
        tokens = sum(c.completion_tokens for c in done)
        s.completion_tokens += tokens
        s.session_tokens += tokens
        if prepared.openai:
            record = openai_result_record(
                prepared,
                done,
                model=self.config.model_name,  # the model that ran, as a server writes it
                token_str=self._token_text(prepared, done),
            )
            lines = [encode_line(record)]
        else:
            records = result_records(
                prepared,
                done,
                with_token_ids=self.config.with_token_ids,
                with_timing=False,
                token_text=self._token_text(prepared, done),
            )
            lines = [encode_line(r) for r in records]
        self.output.add_result(prepared.row, lines)
        self.progress.rows(1)
        if self.hub is not None:
            self.hub.add_rows(lines)
            self.hub.update(s)

    def error(self, error: RowError, openai: bool) -> None:
        """A row that cannot run: its error line (in OpenAI Batch output's shape for such input)."""
        self.summary.add_error(error.type)
        record = openai_error_record(error) if openai else error_record(error)
        line = encode_line(record)
        self.output.add_error(error.row, line)
        self.progress.rows(1)
        if self.hub is not None:
            self.hub.update(self.summary)
            self.hub.add_error(error.row, error.id, error.type, error.message)
            self.hub.add_rows([line])

    def _token_text(self, prepared: PreparedRow, done: list[Completion]):
        """Token id -> text for the logprobs of `done` (new ids decoded in one batch), or None
        when the row asked for no logprobs."""
        if not (prepared.params.logprobs or prepared.params.top_logprobs):
            return None
        return self._token_texts.prepare(logprob_token_ids(done))
