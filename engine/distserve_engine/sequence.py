"""One request's tokens, sampling parameters and KV placement as the engine sees it.

A `Sequence` is plain data so it can be pickled from a prefill instance to a decode
instance; the runner appends tokens, the block manager fills `block_table`, and the
stop checker (`stopping.py`) fills the text fields and `finish_reason`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from distserve_engine.sampling import SamplingParams


@dataclass(frozen=True)
class DetokenizerState:
    """The text fields of a `Sequence` that incremental detokenization carries on from."""

    output_text: str = ""  # text of the output so far (stop strings cut)
    prefix_offset: int = 0  # output index where the last decoded window starts
    read_offset: int = 0  # output index up to which text has been emitted
    emitted_text_len: int = 0  # chars of output_text already streamed


@dataclass
class Sequence:
    """Tokens of one request and where its KV lives in this instance's cache."""

    seq_id: int | str
    prompt_token_ids: list[int]
    params: SamplingParams = field(default_factory=SamplingParams)
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)  # KV block ids, in token order
    num_cached_tokens: int = 0  # leading tokens whose K/V are in the cache
    finish_reason: str | None = None  # None while running, then "stop" or "length"
    # Incremental detokenization state (see stopping.py).
    output_text: str = ""
    prefix_offset: int = 0  # output index where the last decoded window starts
    read_offset: int = 0  # output index up to which text has been emitted
    emitted_text_len: int = 0  # chars of output_text already returned to the caller

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        """Tokens in the prompt."""
        return len(self.prompt_token_ids)

    @property
    def token_ids(self) -> list[int]:
        """Prompt followed by generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def last_token_id(self) -> int:
        """The newest token (the next decode step's input)."""
        return self.output_token_ids[-1] if self.output_token_ids else self.prompt_token_ids[-1]

    def detached(self) -> Sequence:
        """A copy holding no KV blocks: what a decode instance imports KV into."""
        return replace(
            self, output_token_ids=list(self.output_token_ids), block_table=[],
            num_cached_tokens=0, prompt_token_ids=list(self.prompt_token_ids),
        )

    @property
    def detokenizer_state(self) -> DetokenizerState:
        """Where incremental detokenization stands (travels from prefill to decode)."""
        return DetokenizerState(self.output_text, self.prefix_offset, self.read_offset,
                                self.emitted_text_len)

    def resume_detokenizer(self, state: DetokenizerState) -> None:
        """Continue detokenizing from `state` (a prefill instance's, after its first token)."""
        self.output_text, self.prefix_offset = state.output_text, state.prefix_offset
        self.read_offset, self.emitted_text_len = state.read_offset, state.emitted_text_len

    @property
    def is_finished(self) -> bool:
        """True once a stop condition was met."""
        return self.finish_reason is not None
