"""What a caller asks for and what it gets back.

`SamplingParams` is also the run configuration's `sampling` section (pipeline/config.py builds
it from `sampling.*`), so its fields, defaults and checks are written here once. A check's
message starts with the field's name, which the run configuration prefixes with `sampling.`.
"""
from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_GAMMA_MAX = 5                 # the largest gamma 'auto' may choose unless told otherwise
VERIFY_RULES = ("coupled", "rejection")   # sampling.verify (DESIGN.md invariant 2)
DRAFT_CHOICES = ("auto", "mtp", "ngram", "none")   # draft sources: per row the one that pays, or one, or none


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64          # generated tokens per row at most
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0                # nucleus sampling mass (1.0: off)
    top_k: int = 0                    # keep the k most likely tokens (0: off)
    seed: int = 0                     # fixed seed: the same outputs run to run
    verify: str = "coupled"           # sampling's verification rule: coupled (the same text at every
                                      # gamma, batch, draft source, retry) | rejection (min(1, p/q))
    stop: tuple[str, ...] = ()        # stop strings; the text is cut before the first one
    truncate_prompt: bool = False     # over-long prompts keep their last tokens instead of failing
    ignore_eos: bool = False          # keep generating past EOS (benchmarks)

    def __post_init__(self):
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(str(s) for s in self.stop or ())
        object.__setattr__(self, "stop", stop)
        for ok, message in (
            (_is_int(self.max_new_tokens) and self.max_new_tokens > 0,
             f"max_new_tokens must be an int > 0, got {self.max_new_tokens!r}"),
            (_is_number(self.temperature) and self.temperature >= 0,
             f"temperature must be >= 0, got {self.temperature!r}"),
            (_is_number(self.top_p) and 0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p!r}"),
            (_is_int(self.top_k) and self.top_k >= 0, f"top_k must be an int >= 0 (0 = off), got {self.top_k!r}"),
            (_is_int(self.seed), f"seed must be an int, got {self.seed!r}"),
            (self.verify in VERIFY_RULES, f"verify must be coupled or rejection, got {self.verify!r}"),
            (all(self.stop), "stop must not contain empty strings"),
            (isinstance(self.truncate_prompt, bool),
             f"truncate_prompt must be true or false, got {self.truncate_prompt!r}"),
            (isinstance(self.ignore_eos, bool), f"ignore_eos must be true or false, got {self.ignore_eos!r}"),
        ):
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def coupled(self) -> bool:
        """Sampling with coupled verification (greedy keeps its own argmax path)."""
        return not self.greedy and self.verify == "coupled"


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class RequestOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"      # "stop" | "length" | "error"
    num_prompt_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0      # drafts the target accepted (before cutting at EOS/stop/length)
    error: str | None = None
