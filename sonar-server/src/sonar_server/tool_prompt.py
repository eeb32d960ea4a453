"""Sonar's own tool prompt, for models whose chat template does not render ``tools`` (the
embedded SmolLM2 among them): the tools and the call format go into the system message,
followed by one example exchange that calls the first tool (small models follow a shown
exchange far better than an instruction); earlier calls and results enter the conversation as
text; and ``tool_choice: "auto"`` gets a grammar that lets the answer be plain text or
well-formed ``<tool_call>`` JSON whose arguments follow each tool's schema, which the
``hermes`` parser reads."""

from __future__ import annotations

import json
import re
from typing import Any

from sonar.structured_output import GuidedDecodingParams

OPEN_TAG = "<tool_call>"
CLOSE_TAG = "</tool_call>"
PARSER = "hermes"  # reads the format below


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the tokenizer's chat template has a use for ``tools``."""
    template = getattr(tokenizer, "chat_template", None)
    templates = template.values() if isinstance(template, dict) else [template or ""]
    return any("tools" in text for text in templates)


def example_exchange(tool: dict[str, Any]) -> list[dict[str, str]]:
    """A user turn asking for ``tool`` and the assistant turn calling it (``...`` for each argument)."""
    function = tool["function"]
    properties = (function.get("parameters") or {}).get("properties") or {}
    call = {"function": {"name": function["name"], "arguments": {name: "..." for name in properties}}}
    return [{"role": "user", "content": f"Use the {function['name']} tool."}, {"role": "assistant", "content": _call_text(call)}]


def tool_system_prompt(tools: list[dict[str, Any]], opening: str = "You are a helpful assistant with access to these tools:") -> str:
    """The instructions and tool list for the system message."""
    listing = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return (
        f"{opening}\n<tools>\n{listing}\n</tools>\n\n"
        "To call a tool, reply with only a tool call:\n"
        f'{OPEN_TAG}\n{{"name": "tool_name", "arguments": {{"arg": "value"}}}}\n{CLOSE_TAG}\n'
        "If no tool fits, answer normally."
    )


def _call_text(call: dict[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return f"{OPEN_TAG}\n{json.dumps({'name': function.get('name', ''), 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE_TAG}"


def messages_with_tools(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``messages`` with the tool prompt in the system message (one is added when there is
    none) and the example exchange after it, assistant ``tool_calls`` written as
    ``<tool_call>`` text and ``tool`` results as user turns in ``<tool_response>`` tags, for a
    template that knows only text turns."""
    result: list[dict[str, Any]] = []
    for message in messages:
        entry = {key: value for key, value in message.items() if key not in ("tool_calls", "tool_call_id", "name")}
        if message.get("role") == "assistant" and message.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in message["tool_calls"])
            entry["content"] = "\n".join(part for part in (message.get("content") or "", calls) if part)
        elif message.get("role") == "tool":
            entry = {"role": "user", "content": f"<tool_response>\n{message.get('content') or ''}\n</tool_response>"}
        result.append(entry)
    if result and result[0].get("role") == "system":
        prompt = tool_system_prompt(tools, "You have access to these tools:")
        system = {**result[0], "content": f"{result[0].get('content') or ''}\n\n{prompt}".lstrip()}
        result = result[1:]
    else:
        system = {"role": "system", "content": tool_system_prompt(tools)}
    return [system, *example_exchange(tools[0]), *result]


def auto_tool_grammar(tools: list[dict[str, Any]], parallel: bool) -> GuidedDecodingParams:
    """Plain text that does not begin with ``<``, or one (``parallel``: one or more)
    ``<tool_call>`` blocks each holding ``{"name": N, "arguments": A}`` with ``A`` valid
    against ``N``'s schema."""
    import xgrammar as xgr

    calls = []
    for tool in tools:
        function = tool["function"]
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        head = json.dumps(f'{OPEN_TAG}\n{{"name": {json.dumps(function["name"])}, "arguments": ')
        tail = json.dumps(f"}}\n{CLOSE_TAG}")
        arguments = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)
        calls.append(xgr.Grammar.concat(xgr.Grammar.from_ebnf(f"root ::= {head}"), arguments, xgr.Grammar.from_ebnf(f"root ::= {tail}")))
    one_call = calls[0] if len(calls) == 1 else xgr.Grammar.union(*calls)
    call_rules = re.sub(r"\broot\b", "tool_call", str(one_call))
    repeat = ' ("\\n" tool_call)*' if parallel else ""
    head_rules = f'root ::= tool_calls | free_text\ntool_calls ::= tool_call{repeat}\nfree_text ::= [^<] [^]* | ""\n'
    return GuidedDecodingParams(grammar=head_rules + call_rules)
