"""Structured outputs: a request's output constrained to a JSON schema, any JSON object, a regular expression or
a Lark grammar, by llguidance (https://github.com/guidance-ai/llguidance) masking the logits of the constrained
rows each step.

Why llguidance (measured 2026-11-26 on this 2-core machine, contended, SmolLM2's 49,152-token vocabulary, a
nested schema with an enum array, a pattern and required fields): compile 1-30 ms per schema, token mask
0.02 ms median / 0.37 ms mean per token; xgrammar 0.2.8 masks faster (0.002 ms median, its compile 60 ms) but
needs torch, triton and transformers at install, where llguidance has no dependencies and reads the engine's
own tokenizer.json; it takes JSON schemas, regexes and Lark grammars natively (vLLM's `guided_grammar` form).

A constraint is compiled when its request is validated (LLM.make_sequence): an invalid schema, regex or
grammar is a ValueError naming the problem before any work. The executor (runtime/batching/executor.py) asks
each constrained row's Guide to mask its logits before sampling and to consume the token chosen; other rows
are untouched. Constrained rows read full logits (SamplingParams.full_logits) and never speculate."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

KINDS = ("json_schema", "json_object", "regex", "grammar")
# JSON as json.dumps writes it: no free whitespace between tokens (a small model would spend its tokens on it;
# a schema's own "x-guidance" options override this)
JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match: `kind` one of KINDS, `spec` the schema (JSON text), regex or Lark
    grammar ("" for json_object). Build with the class methods."""

    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"StructuredOutput.kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if not isinstance(self.spec, str):
            raise ValueError(f"StructuredOutput.spec must be a str, got {type(self.spec).__name__}")

    @classmethod
    def json(cls, schema: dict | str) -> StructuredOutput:
        """Output valid against a JSON schema (a dict or its JSON text)."""
        return cls("json_schema", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        """Any JSON object."""
        return cls("json_object")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        return cls("regex", pattern)

    @classmethod
    def grammar(cls, lark: str) -> StructuredOutput:
        """A Lark grammar (llguidance's dialect: `start: ...`, regex terminals, %json {...})."""
        return cls("grammar", lark)

    def grammar_text(self) -> str:
        from llguidance import LLMatcher

        if self.kind == "json_schema":
            try:
                schema = json.loads(self.spec)
            except json.JSONDecodeError as err:
                raise ValueError(f"the JSON schema is not valid JSON: {err}") from None
            if not isinstance(schema, dict):
                raise ValueError(f"a JSON schema is an object, got {type(schema).__name__}")
            return LLMatcher.grammar_from_json_schema(schema, defaults=JSON_LAYOUT)
        if self.kind == "json_object":
            return LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_LAYOUT)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.spec)
        return LLMatcher.grammar_from_lark(self.spec)


@lru_cache(maxsize=8)
def _ll_tokenizer(tokenizer, vocab_size: int, eos_ids: tuple[int, ...]):
    """llguidance's view of an engine's tokenizer (built once per engine: ~1-3 s for a 50k vocabulary)."""
    from llguidance import LLTokenizer

    return LLTokenizer(tokenizer.to_str(), n_vocab=vocab_size, eos_token=list(eos_ids))


class Guide:
    """One sequence's grammar state: `mask` its next token's logits, `consume` the token chosen."""

    def __init__(self, constraint: StructuredOutput, tokenizer, vocab_size: int, eos_ids: frozenset[int]):
        from llguidance import LLMatcher

        self.constraint, self.vocab_size = constraint, vocab_size
        grammar = constraint.grammar_text()
        self.matcher = LLMatcher(_ll_tokenizer(tokenizer, vocab_size, tuple(sorted(eos_ids))), grammar, log_level=0)
        if self.matcher.is_error():
            raise ValueError(f"invalid {constraint.kind.replace('_', ' ')}: {self.matcher.get_error()}")
        self._bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def allowed(self) -> np.ndarray:
        """bool [vocab]: the tokens the grammar allows next (only EOS once it is complete)."""
        self._fill()
        return self._unpacked()

    def mask(self, logits_row: np.ndarray, argmax_only: bool = False) -> np.ndarray:
        """The row's logits with every token the grammar forbids at -inf; RuntimeError if the grammar failed.
        `argmax_only`: the row takes its logits' argmax and nothing else reads them (greedy, no penalty, no
        logprobs); when the grammar allows that token the logits come back as they are, since masking could not
        change the pick (most steps of a model that follows its prompt: no mask is computed)."""
        if self.matcher.is_error():
            raise RuntimeError(f"the {self.constraint.kind} constraint failed: {self.matcher.get_error()}")
        if argmax_only and self.matcher.validate_tokens([int(np.argmax(logits_row))]) == 1:
            return logits_row  # the grammar checks that one token (~2 us) instead of computing its mask (~40 us)
        self._fill()
        allowed = self._unpacked()
        if not allowed.any():
            raise RuntimeError(f"the {self.constraint.kind} constraint allows no token: {self.matcher.get_error()}")
        return np.where(allowed, logits_row, np.float32(-np.inf)).astype(np.float32, copy=False)

    def _fill(self) -> None:
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.matcher, self._bits, 0)

    def _unpacked(self) -> np.ndarray:
        return np.unpackbits(self._bits[0].view(np.uint8), bitorder="little")[:self.vocab_size].astype(bool)

    def consume(self, token: int) -> None:
        self.matcher.consume_token(int(token))
