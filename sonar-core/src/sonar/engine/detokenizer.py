"""Incremental detokenization with stop-string detection, O(new tokens) per step."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import tokenizers

from sonar.sampling_params import SamplingParams

# prompt tokens decoded as left context, so the first output token keeps its leading space
_PROMPT_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


def _ids_decoder(tokenizer: Any, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """``ids -> text`` as ``tokenizer.decode(ids, skip_special_tokens=...)`` computes it; for a
    fast tokenizer that cleans up no spaces, its Rust decoder called directly (what the Python
    wrapper calls, less the wrapper's per-call cost: two decodes a token, every stream)."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if isinstance(backend, tokenizers.Tokenizer) and not getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return functools.partial(backend.decode, skip_special_tokens=skip_special_tokens)
    return functools.partial(tokenizer.decode, skip_special_tokens=skip_special_tokens)


class IncrementalDetokenizer:
    """Turns a request's output token ids into text as they arrive, and finds stop strings.

    Each ``append`` decodes only a short window of tokens: ``ids[prefix_offset:read_offset]``
    (text already emitted) and ``ids[prefix_offset:]``; the difference is the new text. When
    the new text ends in an incomplete UTF-8 character (U+FFFD), nothing is emitted until a
    later token completes it, so multi-byte characters split across tokens never show up as
    replacement characters mid-stream.

    Stop strings are searched only in the new text plus ``len(longest stop) - 1`` characters
    before it. ``get_delta()`` hands out text that is safe to stream: it holds back the last
    ``len(longest stop) - 1`` characters, which could be the start of a stop string.
    """

    def __init__(self, tokenizer: Any | None, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """:param tokenizer: a Hugging Face tokenizer, or None (``skip_tokenizer_init``): text stays "".
        :param prompt_token_ids: the prompt; its last few tokens are decoding context only.
        :param params: uses ``stop``, ``include_stop_str_in_output``, ``skip_special_tokens``,
            ``detokenize``.
        """
        self.tokenizer = tokenizer if params.detokenize else None
        self.params = params
        if self.tokenizer is not None:  # without one, append() returns before decoding
            self._decode = _ids_decoder(self.tokenizer, params.skip_special_tokens)
        self.stop_strings: list[str] = list(params.stop or [])
        self.max_stop_len = max((len(s) for s in self.stop_strings), default=0)
        self.output_text = ""
        self.stop_reason: str | None = None  # the stop string that matched
        # decoding window over prompt tail + output ids
        context = prompt_token_ids[-_PROMPT_CONTEXT_TOKENS:]
        self._token_ids: list[int] = list(context)
        self._prefix_offset = 0
        self._read_offset = len(context)
        self._streamed_offset = 0  # chars of output_text handed out by get_delta
        self._num_output_tokens = 0  # stop strings count only past params.min_tokens of them

    @property
    def finished(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_ids: list[int]) -> str | None:
        """Add newly generated tokens; return the stop string that matched, if any.

        On a match ``output_text`` ends right before the stop string (or right after it with
        ``include_stop_str_in_output``). After a match, further tokens are ignored. While the
        output is at most ``min_tokens`` tokens long no stop string is looked for (as EOS and
        stop token ids are held off); one that ends in later text matches.
        """
        if self.tokenizer is None or self.finished or not token_ids:
            return None
        self._token_ids.extend(token_ids)
        self._num_output_tokens += len(token_ids)
        new_text = self._decode_new_text()
        if not new_text:
            return None
        previous_len = len(self.output_text)
        self.output_text += new_text
        if self.stop_strings and self._num_output_tokens > self.params.min_tokens:
            return self._check_stop(previous_len)
        return None

    def get_delta(self, flush: bool = False) -> str:
        """Text that became safe to stream since the last call.

        :param flush: the request finished for another reason (eos, length, abort): hand out
            the held-back tail too.
        """
        end = len(self.output_text)
        if not (flush or self.finished) and self.max_stop_len > 1:
            end = max(self._streamed_offset, end - (self.max_stop_len - 1))
        delta = self.output_text[self._streamed_offset:end]
        self._streamed_offset = end
        return delta

    # internals

    def _decode_new_text(self) -> str:
        ids = self._token_ids
        prefix_text = self._decode(ids[self._prefix_offset:self._read_offset])
        full_text = self._decode(ids[self._prefix_offset:])
        if len(full_text) <= len(prefix_text) or full_text.endswith(_REPLACEMENT_CHAR):
            return ""  # an incomplete character (or a skipped special token): wait
        # slide the window: what was new becomes the prefix; drop ids before it
        del ids[: self._read_offset]
        self._prefix_offset, self._read_offset = 0, len(ids)
        return full_text[len(prefix_text):]

    def _check_stop(self, previous_len: int) -> str | None:
        text = self.output_text
        search_from = max(0, previous_len - self.max_stop_len + 1)
        best: tuple[int, str] | None = None
        for stop in self.stop_strings:
            position = text.find(stop, search_from)
            if position != -1 and (best is None or position < best[0]):
                best = (position, stop)
        if best is None:
            return None
        position, stop = best
        end = position + len(stop) if self.params.include_stop_str_in_output else position
        self.output_text = text[:end]
        self._streamed_offset = min(self._streamed_offset, end)
        self.stop_reason = stop
        return stop
