"""SamplingParams: the per-request decoding settings the runtime's sampler and text stream consume."""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from runtime.request.structured import StructuredOutput


MAX_PENALTY = 1e6
MAX_LOGPROBS = 20  # alternatives per token at most (OpenAI's top_logprobs bound)  # the penalty scales float32 logits: far outside [1/this, this] they overflow to inf or 0


def _bad(field: str, value: object, allowed: str) -> ValueError:
    return ValueError(f"SamplingParams.{field} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the next token and when to stop, for one request.

    temperature: 0 selects greedy decoding (argmax); > 0 scales the logits before softmax.
    top_k: keep only the k highest logits (ties with the k-th kept too); 0 disables it.
    top_p: nucleus sampling, keep the smallest high-probability set whose mass reaches top_p; 1 disables it.
    repetition_penalty: transformers' CTRL-style penalty on every token already in prompt + output; 1 disables it.
    seed: seed for this request's np.random.Generator (None: fresh OS entropy).
    max_new_tokens: upper bound on generated tokens (>= 1).
    stop: strings that end generation; the returned text stops before the first one. A list is accepted.
    ignore_eos: keep generating past the end-of-sequence token.
    logprobs: None, or return each generated token's log-probability with this many most likely alternatives
        (0..20; 0: the token's own only), see runtime/request/logprobs.py for which logits they come from.
    prompt_logprobs: None, or score every prompt token (but the first) likewise, with this many alternatives.
    structured: None, or a StructuredOutput (runtime/request/structured.py) the output must match: a JSON schema,
        any JSON object, a regex or a Lark grammar; the engine compiles it when the request is validated.
    adapter: None (the base model), or the name of a LoRA adapter loaded into the engine (`LLM.load_adapter`).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 64
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    structured: StructuredOutput | None = None
    adapter: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        elif not isinstance(self.stop, tuple):
            try:
                object.__setattr__(self, "stop", tuple(self.stop))
            except TypeError:
                raise _bad("stop", self.stop, "a tuple or list of non-empty strings") from None
        self._validate()

    def _validate(self) -> None:
        t = self.temperature
        if not _is_real(t) or not math.isfinite(t) or t < 0:
            raise _bad("temperature", t, "a finite number >= 0 (0 means greedy)")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise _bad("top_k", self.top_k, "an integer >= 0 (0 disables top-k)")
        p = self.top_p
        if not _is_real(p) or not (0.0 < p <= 1.0):
            raise _bad("top_p", p, "a number with 0 < top_p <= 1 (1 disables top-p)")
        r = self.repetition_penalty
        if not _is_real(r) or not math.isfinite(r) or not 1 / MAX_PENALTY <= r <= MAX_PENALTY:
            raise _bad("repetition_penalty", r, f"a number from {1 / MAX_PENALTY:g} to {MAX_PENALTY:g} "
                                                f"(1 disables it)")
        if self.seed is not None and (not _is_int(self.seed) or self.seed < 0):
            raise _bad("seed", self.seed, "None or an integer >= 0")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise _bad("max_new_tokens", self.max_new_tokens, "an integer >= 1")
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise _bad("stop", self.stop, "a tuple of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            raise _bad("ignore_eos", self.ignore_eos, "a bool")
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(self, name)
            if n is not None and (not _is_int(n) or not 0 <= n <= MAX_LOGPROBS):
                raise _bad(name, n, f"None or an integer from 0 to {MAX_LOGPROBS} (alternatives per token)")
        if self.adapter is not None and (not isinstance(self.adapter, str) or not self.adapter):
            raise _bad("adapter", self.adapter, "None (the base model) or a loaded adapter's name")
        if self.structured is not None:
            if not isinstance(self.structured, StructuredOutput):
                raise _bad("structured", self.structured, "None or a StructuredOutput (StructuredOutput.json(schema), "
                                                          ".regex(pattern), .grammar(lark), .json_object())")
            if self.ignore_eos:
                raise _bad("ignore_eos", self.ignore_eos, "False with structured (the output ends where it matches)")

    @property
    def full_logits(self) -> bool:
        """Whether the row needs the engine's full logits every step (log-probabilities, a grammar's mask), not a
        sampling head's pick."""
        return self.logprobs is not None or self.prompt_logprobs is not None or self.structured is not None

    @property
    def greedy(self) -> bool:
        """True when the next token is the argmax (temperature == 0)."""
        return self.temperature == 0.0
