"""``speculative_config`` as users give it, checked against the registered proposers."""

from __future__ import annotations

from typing import Any

from sonar.spec_decode.interface import SpeculativeConfig


def resolve_speculative_config(value: SpeculativeConfig | dict[str, Any] | None) -> SpeculativeConfig | None:
    """The plain-data config the engine core runs (None: no speculation).

    :raises ValueError: a malformed config, a method no plugin registers (the message lists
        the registered ones), or options the method refuses.
    """
    if value is None:
        return None
    from sonar.registry import load_registered, speculative_proposers

    config = SpeculativeConfig.from_value(value)
    registered = speculative_proposers()
    if config.method not in registered:
        raise ValueError(
            f"speculative_config method {config.method!r} is not registered; registered: "
            f"{', '.join(sorted(registered)) or 'none'} (install the plugin that provides it)"
        )
    proposer_cls = load_registered("speculative proposer", config.method, registered)
    proposer_cls.check_config(config)
    if config.verify_passes > 1 and not (proposer_cls.drafts_between_passes or proposer_cls.drafts_in_passes):
        raise ValueError(
            f"speculative_config['verify_passes'] > 1 needs a proposer that drafts between passes "
            f"(such as \"ngram\", \"dflash\" or \"dspark\"); {config.method!r} does not"
        )
    return config
