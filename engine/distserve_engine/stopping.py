"""Incremental detokenization and stop decisions for streaming.

After each new token, `StopChecker.update` turns the sequence's new tokens into new
text and decides `finish_reason`: "stop" for a stop token (EOS unless `ignore_eos`, or
`stop_token_ids`) or a stop string, "length" for `max_tokens` or the context limit.
Stop strings are cut from the text, and while a request runs the last
(longest stop string - 1) characters are held back, so a client never receives the
beginning of a stop string that later completes.
"""

from __future__ import annotations

from distserve_engine.sequence import Sequence
from distserve_engine.tokenizer import Tokenizer

# A decode that ends in U+FFFD is a UTF-8 character split across tokens: wait for more.
REPLACEMENT_CHAR = "\ufffd"


class StopChecker:
    """Applies the stop rules of each sequence's SamplingParams."""

    def __init__(self, tokenizer: Tokenizer, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len

    def update(self, seq: Sequence) -> str:
        """Account for the newest token; return the text that may now be streamed."""
        if seq.is_finished:
            return ""
        token_id = seq.output_token_ids[-1]
        if self._is_stop_token(seq, token_id):
            seq.finish_reason = "stop"
            return self._emit(seq, hold_chars=0)
        self._detokenize(seq)
        if self._cut_stop_string(seq):
            seq.finish_reason = "stop"
        elif len(seq.output_token_ids) >= seq.params.max_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = "length"
        hold = 0 if seq.is_finished else max((len(s) for s in seq.params.stop), default=1) - 1
        return self._emit(seq, hold_chars=hold)

    def _is_stop_token(self, seq: Sequence, token_id: int) -> bool:
        if token_id in seq.params.stop_token_ids:
            return True
        return not seq.params.ignore_eos and token_id in self.tokenizer.eos_token_ids

    def _detokenize(self, seq: Sequence) -> None:
        ids = seq.output_token_ids
        prefix_text = self.tokenizer.decode(ids[seq.prefix_offset:seq.read_offset])
        full_text = self.tokenizer.decode(ids[seq.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT_CHAR):
            seq.output_text += full_text[len(prefix_text):]
            seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)

    def _cut_stop_string(self, seq: Sequence) -> bool:
        """Truncate output_text at the first stop string; True if one was found."""
        if not seq.params.stop:
            return False
        longest = max(len(s) for s in seq.params.stop)
        # Only text new since the last check (plus overlap) can hold a new match.
        search_from = max(0, seq.emitted_text_len - longest)
        hits = [i for s in seq.params.stop if (i := seq.output_text.find(s, search_from)) >= 0]
        if not hits:
            return False
        seq.output_text = seq.output_text[: min(hits)]
        return True

    def _emit(self, seq: Sequence, hold_chars: int) -> str:
        end = max(seq.emitted_text_len, len(seq.output_text) - hold_chars)
        delta = seq.output_text[seq.emitted_text_len:end]
        seq.emitted_text_len = end
        return delta
