"""What a caller asks for and what it gets back."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 64
    temperature: float = 0.0          # 0: greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0: no top-k filter
    seed: int = 0
    stop: tuple[str, ...] = ()        # stop strings; the text is cut before the first one
    ignore_eos: bool = False          # keep generating past EOS (benchmarks)
    truncate_prompt: bool = False     # over-long prompts keep their last tokens instead of failing

    def __post_init__(self):
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must be non-empty")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


@dataclass
class RequestOutput:
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str = "error"      # "stop" | "length" | "error"
    num_prompt_tokens: int = 0
    num_drafted_tokens: int = 0
    num_accepted_tokens: int = 0      # drafts the target accepted (before cutting at EOS/stop/length)
    error: str | None = None
