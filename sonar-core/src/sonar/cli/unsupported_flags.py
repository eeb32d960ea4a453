"""vLLM's command-line flags that Sonar does not have yet, in one table.

Each is still added to the parser, so that a vLLM user's command line fails at once with
``--X is not supported yet`` and the feature (and the issue that brings it) named, instead of
argparse's generic usage. A value that means "off" (``-tp 1``) is accepted silently.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class UnsupportedFlag:
    flag: str
    feature: str
    issue: int | None = None  # the open issue that brings it; None: not planned yet
    short: str | None = None
    takes_value: bool = True
    accepted: frozenset[str] = field(default_factory=frozenset)  # values that mean "off"
    server_only: bool = False  # a flag of vLLM's HTTP frontend, not of its engine

    @property
    def planned(self) -> str:
        return f"issue {self.issue} brings it" if self.issue else "no open issue plans it yet"

    @property
    def message(self) -> str:
        return f"{self.flag} is not supported yet ({self.feature}; {self.planned})"


def _flag(flag: str, feature: str, issue: int | None = None, **kwargs) -> UnsupportedFlag:
    accepted = kwargs.pop("accepted", ())
    return UnsupportedFlag(flag, feature, issue, accepted=frozenset(accepted), **kwargs)


QUANTIZATION, SPECULATIVE, KV_TRANSFER, LORA, PARALLELISM = 14, 15, 17, 18, 19

UNSUPPORTED_FLAGS: tuple[UnsupportedFlag, ...] = (
    # quantization
    _flag("--calculate-kv-scales", "FP8 KV-cache scales", QUANTIZATION, takes_value=False),
    # speculative decoding
    _flag("--num-lookahead-slots", "speculative decoding", SPECULATIVE, accepted=("0",)),
    # KV transfer
    _flag("--kv-events-config", "KV-cache events", KV_TRANSFER),
    _flag("--cpu-offload-gb", "offloading weights to CPU memory", KV_TRANSFER, accepted=("0",)),
    # LoRA
    _flag("--fully-sharded-loras", "LoRA adapters", LORA, takes_value=False),
    _flag("--lora-dtype", "LoRA adapters", LORA),
    # parallelism
    _flag("--decode-context-parallel-size", "decode context parallelism", PARALLELISM, short="-dcp", accepted=("1",)),
    _flag("--enable-eplb", "expert-parallel load balancing", PARALLELISM, takes_value=False),
    _flag("--data-parallel-size-local", "multi-node data parallelism", PARALLELISM, short="-dpl"),
    _flag("--data-parallel-rank", "multi-node data parallelism", PARALLELISM, short="-dpn"),
    _flag("--data-parallel-start-rank", "multi-node data parallelism", PARALLELISM, short="-dpr"),
    _flag("--data-parallel-address", "multi-node data parallelism", PARALLELISM, short="-dpa"),
    _flag("--data-parallel-rpc-port", "multi-node data parallelism", PARALLELISM, short="-dpp"),
    _flag("--data-parallel-backend", "multi-node data parallelism", PARALLELISM, short="-dpb"),
    _flag("--disable-custom-all-reduce", "tensor parallelism", PARALLELISM, takes_value=False),
    # not planned in an open issue yet
    _flag("--compilation-config", "torch.compile and CUDA-graph settings (Sonar compiles nothing with torch.compile: levels 0-3 are accepted; --enforce-eager turns CUDA graphs off)",
          short="-O", accepted=("0", "1", "2", "3")),
    _flag("--guided-decoding-backend", "structured-output backends other than xgrammar", accepted=("xgrammar", "auto")),
    _flag("--task", "pooling models (embeddings, classification, scores); Sonar generates", accepted=("auto", "generate")),
    _flag("--runner", "pooling models (embeddings, classification, scores); Sonar generates", accepted=("auto", "generate")),
    _flag("--convert", "converting a model for pooling", accepted=("auto", "none")),
    _flag("--rope-scaling", "a flag of its own for RoPE scaling; give it as --hf-overrides '{\"rope_scaling\": {...}}', as vLLM now does"),
    _flag("--tokenizer-mode", "tokenizer modes (Sonar uses the fast tokenizer)", accepted=("auto",)),
    _flag("--limit-mm-per-prompt", "multimodal inputs"),
    _flag("--mm-processor-kwargs", "multimodal inputs"),
    _flag("--enable-prompt-embeds", "prompt embeddings", takes_value=False),
    _flag("--enable-sleep-mode", "sleep mode", takes_value=False),
)


@dataclass(frozen=True, slots=True)
class IgnoredFlag:
    """A vLLM flag accepted with any value that changes nothing here, and why."""

    flag: str
    reason: str
    takes_value: bool = True


#: vLLM flags whose effect Sonar has anyway, or that vLLM's own V1 engine ignores: accepted,
#: so a vLLM command line runs unchanged
IGNORED_FLAGS: tuple[IgnoredFlag, ...] = (
    IgnoredFlag("--swap-space", "preempted requests are recomputed, as in vLLM's V1 engine, which ignores it too"),
    IgnoredFlag("--max-seq-len-to-capture", "decode graphs are captured by batch size and serve every context length"),
)


class _IgnoreFlag(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, entry: IgnoredFlag, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=None if entry.takes_value else 0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str | Sequence[str] | None, option_string: str | None = None) -> None:
        """Nothing to set: the flag's effect is Sonar's behaviour already."""


class _RefuseFlag(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str, entry: UnsupportedFlag, **kwargs) -> None:
        self.entry = entry
        super().__init__(option_strings, dest, nargs=None if entry.takes_value else 0, default=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: str | Sequence[str] | None, option_string: str | None = None) -> None:
        if isinstance(values, str) and values in self.entry.accepted:
            return
        parser.exit(2, f"{parser.prog}: error: {self.entry.message}\n")


def add_unsupported_flags(parser: argparse.ArgumentParser, server: bool = False) -> None:
    """Add the table's flags to ``parser`` (the frontend's too when ``server``), each refusing
    itself with its message when given."""
    group = parser.add_argument_group("vLLM flags not supported yet (each fails at once, naming its feature)")
    for entry in UNSUPPORTED_FLAGS:
        if entry.server_only and not server:
            continue
        names = [entry.flag] + ([entry.short] if entry.short else [])
        help_text = f"not supported yet: {entry.feature} ({entry.planned})"
        group.add_argument(*names, action=_RefuseFlag, entry=entry, metavar="VALUE", help=help_text)
    ignored = parser.add_argument_group("vLLM flags accepted with no effect (Sonar behaves so anyway)")
    for item in IGNORED_FLAGS:
        ignored.add_argument(item.flag, action=_IgnoreFlag, entry=item, metavar="VALUE", help=f"accepted, no effect: {item.reason}")
