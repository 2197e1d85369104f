"""Incremental detokenization and stop strings, for many sequences at once.

Each sequence keeps two offsets into its token ids (prompt included): the text of
ids[prefix:] minus the text of ids[prefix:read] is what its new tokens add, decoded in
context so that leading spaces and multi-byte characters come out right (a trailing U+FFFD
means "incomplete character": wait for the next token). Tokens that add no text (special
tokens under skip_special_tokens, a decoder that drops ids it does not know) still move the
offsets, so the decoded window stays a few tokens long and a step's work does not grow with
the output (it did: a run of such tokens was decoded again at every step). A step makes two
batched tokenizer calls for all sequences, not two per sequence, straight into the Rust
tokenizer of an HF fast tokenizer when no clean-up pass follows (the same text without
transformers' per-item Python wrapper: ~5x less host time per token).

Stop strings: the text is searched where new text could complete one; the output is cut
before it (or after, with include_stop_str_in_output). Until a sequence finishes, its
visible text holds back the last (longest stop string - 1) characters, which could still
turn out to begin a stop string, so streamed text never has to be taken back.
"""

from __future__ import annotations

from dataclasses import dataclass

_CONTEXT_TOKENS = 5  # prompt tokens decoded as context before the first output token
_MAX_WINDOW = 64  # tokens pending text (incomplete characters) before the window moves anyway


@dataclass
class DetokenizerState:
    prefix_offset: int
    read_offset: int
    text: str = ""
    stop_at: int | None = None  # text length the output is cut to after a stop string


class Detokenizer:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None)
        cleanup = bool(getattr(tokenizer, "clean_up_tokenization_spaces", False))
        # HF's fast decode is backend.decode(ids, skip_special_tokens) (+ a clean-up pass when
        # clean_up_tokenization_spaces is set): without that pass, one Rust call does the batch
        self._backend = backend if backend is not None and not cleanup and hasattr(backend, "decode_batch") \
            else None

    def _decode(self, ids: list[list[int]], skip: bool) -> list[str]:
        if self._backend is not None:
            return self._backend.decode_batch(ids, skip_special_tokens=skip)
        return self.tokenizer.batch_decode(ids, skip_special_tokens=skip)

    def start(self, num_prompt_tokens: int) -> DetokenizerState:
        return DetokenizerState(max(0, num_prompt_tokens - _CONTEXT_TOKENS), num_prompt_tokens)

    def update(self, items: list[tuple[object, DetokenizerState]]) -> list[str | None]:
        """items: (sequence, its state) after new tokens were appended; returns, per item,
        the stop string found in the new text (None if none) and advances the texts."""
        groups: dict[bool, list[int]] = {}
        for j, (seq, _st) in enumerate(items):
            groups.setdefault(seq.params.skip_special_tokens, []).append(j)
        deltas = [""] * len(items)
        for skip, idx in groups.items():
            ids = [items[j][0].token_ids for j in idx]
            sts = [items[j][1] for j in idx]
            before = self._decode([t[s.prefix_offset:s.read_offset] for t, s in zip(ids, sts)], skip)
            after = self._decode([t[s.prefix_offset:] for t, s in zip(ids, sts)], skip)
            for j, t, st, a, b in zip(idx, ids, sts, before, after):
                if b.endswith("\ufffd") and len(t) - st.prefix_offset < _MAX_WINDOW:
                    continue  # an incomplete character: the next token completes it
                if len(b) > len(a):
                    deltas[j] = b[len(a):]
                elif b != a and len(t) - st.prefix_offset < _MAX_WINDOW:
                    continue  # the new tokens changed the context's text (rare): keep it in view
                st.prefix_offset, st.read_offset = st.read_offset, len(t)
        found = []
        for (seq, st), delta in zip(items, deltas):
            st.text += delta
            found.append(_find_stop(seq.params, st, len(delta)) if delta else None)
        return found

    @staticmethod
    def visible_text(seq, st: DetokenizerState, finished: bool) -> str:
        if st.stop_at is not None:
            return st.text[: st.stop_at]
        stops = seq.params.stop
        if finished or not stops:
            return st.text
        hold = max(len(s) for s in stops) - 1
        return st.text[: len(st.text) - hold] if hold else st.text


def _find_stop(params, st: DetokenizerState, new_chars: int) -> str | None:
    if not params.stop:
        return None
    text, best = st.text, None
    for s in params.stop:
        i = text.find(s, max(0, len(text) - new_chars - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    if best is None:
        return None
    i, s = best
    st.stop_at = i + len(s) if params.include_stop_str_in_output else i
    return s
