"""Per-request bookkeeping on the host: tokens emitted so far and when to stop."""
from __future__ import annotations

from dataclasses import dataclass, field

from pipeline.engine.params import RequestOutput, SamplingParams


@dataclass
class Row:
    index: int                 # position in the caller's prompt list
    prompt_ids: list[int]
    max_new: int               # max_new_tokens, capped by the model's context
    out: RequestOutput
    key: int = -1              # random-stream key (defaults to index)
    tokens: list[int] = field(default_factory=list)
    finished: bool = False
    drafted_steps: int = 0     # verify steps with drafts ...
    first_hits: int = 0        # ... and those whose first draft was accepted (the policy's per-row a_1)

    def __post_init__(self):
        if self.key == -1:
            self.key = self.index

    def emit(self, new_tokens: list[int], params: SamplingParams, eos_ids: frozenset[int], tokenizer) -> None:
        """Append the step's tokens, stopping at EOS, a stop string, or the token budget."""
        for tok in new_tokens:
            self.tokens.append(tok)
            if tok in eos_ids and not params.ignore_eos:
                return self._finish("stop")
            if len(self.tokens) >= self.max_new:
                return self._finish("length")
        if params.stop and tokenizer is not None and self._hit_stop(params.stop, tokenizer):
            return self._finish("stop")

    def _hit_stop(self, stops: tuple[str, ...], tokenizer) -> bool:
        window = max(len(s) for s in stops) + 8          # tokens: each covers >= 1 byte or so
        tail = tokenizer.decode(self.tokens[-window:], skip_special_tokens=True)
        return any(s in tail for s in stops)

    def _finish(self, reason: str) -> None:
        self.finished = True
        self.out.finish_reason = reason

    def finalize(self, params: SamplingParams, tokenizer) -> RequestOutput:
        out = self.out
        out.token_ids = list(self.tokens)
        if tokenizer is not None:
            text = tokenizer.decode(self.tokens, skip_special_tokens=True)
            cut = [text.find(s) for s in params.stop if s in text]
            out.text = text[:min(cut)] if cut else text
        if not self.finished:
            out.finish_reason = "length"
        return out
