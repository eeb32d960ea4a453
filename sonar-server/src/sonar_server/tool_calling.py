"""Tools and reasoning for chat surfaces: how a request's ``tools`` / ``tool_choice`` become a
grammar or a parser, and how a choice's text becomes reasoning, content and tool calls (whole
or streamed). Parsing never fails a request: what does not parse (``NaN`` and ``Infinity``
included: they are not JSON) is returned as content; a call cut off by ``max_tokens`` is
returned as a call with its partial arguments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from sonar.structured_output import GuidedDecodingParams

from sonar_server import strict_json
from sonar_server.errors import ApiError
from sonar_server.json_closer import closing_suffix
from sonar_server.parsers import (
    ReasoningParser,
    ReasoningStream,
    StreamEvent,
    ToolCall,
    ToolCallResult,
    ToolCallStream,
    ToolParser,
    make_reasoning_parser,
    make_tool_parser,
)
from sonar_server.parsers.base import call_from_object, decode_json_prefix
from sonar_server.parsers.partial import partial_call_list, with_cut_call
from sonar_server.settings import ServerSettings
from sonar_server.tool_prompt import PARSER as SONAR_PROMPT_PARSER
from sonar_server.tool_prompt import (
    auto_tool_grammar,
    messages_with_tools,
    template_renders_tools,
)

DEFAULT_TOOL_PARSER = "hermes"  # for tool_choice "auto" without --tool-call-parser; the format of Sonar's tool prompt
MAX_TOOLS = 128  # tools a request may define (OpenAI's own limit)


@dataclass(slots=True)
class ToolSpec:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        function: dict[str, Any] = {"name": self.name}
        if self.description:
            function["description"] = self.description
        function["parameters"] = self.parameters
        return {"type": "function", "function": function}


@dataclass(slots=True)
class ToolPlan:
    """How one request uses its tools.

    ``mode``: ``none`` (tools shown to the template, output is text), ``auto`` (the configured
    parser finds calls in the text), ``required`` (a grammar forces a JSON list of calls) or
    ``named`` (a grammar forces the arguments of ``named``). ``sonar_prompt``: the model's
    chat template does not render tools, so Sonar's tool prompt does (``tool_prompt``), read
    by the ``hermes`` parser, with ``auto_guide`` as the grammar of ``auto``.
    """

    mode: str = "none"
    tools: list[ToolSpec] = field(default_factory=list)
    named: str | None = None
    parser: ToolParser | None = None
    parallel: bool = True
    sonar_prompt: bool = False
    auto_guide: GuidedDecodingParams | None = None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        """The tools in OpenAI's format, for the chat template."""
        return [tool.openai() for tool in self.tools] or None

    @property
    def guide(self) -> GuidedDecodingParams | None:
        """The grammar that enforces ``required`` and ``named``."""
        if self.mode == "named":
            return GuidedDecodingParams(json=self._tool(self.named).parameters)
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {"name": {"enum": [tool.name]}, "parameters": tool.parameters},
                    "required": ["name", "parameters"],
                }
                for tool in self.tools
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return GuidedDecodingParams(json=schema)
        return self.auto_guide if self.mode == "auto" else None

    def adapt_to(self, tokenizer: Any) -> None:
        """Use Sonar's tool prompt when the tokenizer's chat template has no place for tools
        (under ``auto``, building its grammar from every tool's schema: call it off the event loop)."""
        if self.mode == "none" or not self.tools or template_renders_tools(tokenizer):
            return
        self.sonar_prompt = True
        if self.mode == "auto":
            self.parser = make_tool_parser(SONAR_PROMPT_PARSER)
            try:
                self.auto_guide = auto_tool_grammar([tool.openai() for tool in self.tools], self.parallel)
            except (RuntimeError, ValueError) as exc:  # xgrammar's word on a schema it cannot compile
                raise ApiError(400, f"a tool's parameters are not a JSON schema Sonar can follow: {exc}", param="tools") from exc

    def render_inputs(self, messages: list[dict[str, Any]], template_kwargs: dict[str, Any]) -> list[dict[str, Any]]:
        """The messages for the chat template, with the tools in ``template_kwargs`` or, under
        Sonar's prompt, in the messages."""
        if self.sonar_prompt:
            return messages_with_tools(messages, [tool.openai() for tool in self.tools])
        if self.template_tools:
            template_kwargs.setdefault("tools", self.template_tools)
        return messages

    def constraint(self, requested: GuidedDecodingParams | None) -> GuidedDecodingParams | None:
        """The request's grammar: a forced call's, or the one ``requested`` (response_format,
        guided_*), which also replaces ``auto``'s; a forced call with another constraint is a 400."""
        if self.mode in ("named", "required"):
            if requested is not None:
                raise ApiError(400, f"tool_choice {self.mode!r} already constrains the output; leave out response_format and guided_*", param="tool_choice")
            return self.guide
        return requested or self.guide

    @property
    def needs_special_tokens(self) -> bool:
        return self.mode == "auto" and self.parser is not None and self.parser.needs_special_tokens

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool.name for tool in self.tools)

    def _tool(self, name: str | None) -> ToolSpec:
        return next(tool for tool in self.tools if tool.name == name)

    def parse(self, text: str, truncated: bool = False) -> ToolCallResult:
        """Split a whole output into content and calls (``truncated``: cut by ``max_tokens``)."""
        if self.mode == "named":
            decoded = decode_json_prefix(text)
            if truncated and decoded is None and text.strip():
                return ToolCallResult("", [ToolCall(self.named or "", text.strip())])
            if decoded is None or text[decoded[1]:].strip():
                return ToolCallResult(text)
            return ToolCallResult("", [ToolCall(self.named or "", text.strip())])
        if self.mode == "required":
            return _parse_required(text, truncated, self.names)
        if self.mode == "auto" and self.parser is not None:
            result = self.parser.extract(text)
            return with_cut_call(self.parser, result) if truncated else result
        return ToolCallResult(text)


def _parse_required(text: str, truncated: bool = False, names: tuple[str, ...] = ()) -> ToolCallResult:
    if truncated and decode_json_prefix(text) is None:
        return ToolCallResult("", partial_call_list(text, names))  # forced calls are never text
    decoded = decode_json_prefix(text)
    if decoded is None or not isinstance(decoded[0], list) or text[decoded[1]:].strip():
        return ToolCallResult(text)
    calls = [call_from_object(item, ("parameters", "arguments")) for item in decoded[0]]
    if not calls or any(call is None for call in calls):
        return ToolCallResult(text)
    return ToolCallResult("", calls)  # type: ignore[arg-type]


def _tool_specs(tools: list[dict[str, Any]], anthropic: bool) -> list[ToolSpec]:
    if len(tools) > MAX_TOOLS:
        raise ApiError(400, f"a request may define at most {MAX_TOOLS} tools, got {len(tools)}", param="tools")
    specs: list[ToolSpec] = []
    for number, tool in enumerate(tools):
        where = f"tools[{number}]"
        if anthropic:
            name, description, parameters = tool.get("name"), tool.get("description"), tool.get("input_schema")
        else:
            if tool.get("type", "function") != "function" or not isinstance(tool.get("function"), dict):
                raise ApiError(400, f"{where}: only tools of type 'function' with a 'function' object are supported", param="tools")
            function = tool["function"]
            name, description, parameters = function.get("name"), function.get("description"), function.get("parameters")
        if not isinstance(name, str) or not name:
            raise ApiError(400, f"{where}: a tool needs a name", param="tools")
        if parameters is None:
            parameters = {"type": "object", "properties": {}}
        if not isinstance(parameters, dict):
            raise ApiError(400, f"{where}: parameters must be a JSON schema object", param="tools")
        specs.append(ToolSpec(name, description, parameters))
    return specs


def _auto_parser(settings: ServerSettings) -> ToolParser:
    return make_tool_parser(settings.tool_call_parser or DEFAULT_TOOL_PARSER)


def openai_tool_plan(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel_tool_calls: bool | None, settings: ServerSettings) -> ToolPlan:
    """The plan for OpenAI's ``tools``, ``tool_choice`` and ``parallel_tool_calls``."""
    if not tools:
        if tool_choice not in (None, "none", "auto"):
            raise ApiError(400, "tool_choice needs tools", param="tool_choice")
        return ToolPlan()
    specs = _tool_specs(tools, anthropic=False)
    parallel = parallel_tool_calls is not False
    if tool_choice == "none":
        return ToolPlan("none", specs)
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", specs, parser=_auto_parser(settings), parallel=parallel)
    if tool_choice == "required":
        return ToolPlan("required", specs, parallel=parallel)
    if isinstance(tool_choice, dict) and isinstance(tool_choice.get("function"), dict):
        return _named(specs, tool_choice["function"].get("name"))
    raise ApiError(400, "tool_choice must be 'none', 'auto', 'required' or {'type': 'function', 'function': {'name': ...}}", param="tool_choice")


def anthropic_tool_plan(tools: list[dict[str, Any]] | None, tool_choice: dict[str, Any] | None, settings: ServerSettings) -> ToolPlan:
    """The plan for Anthropic's ``tools`` and ``tool_choice`` (``auto``, ``any``, ``tool``, ``none``)."""
    choice = {"type": "auto"} if tool_choice is None else tool_choice
    kind = choice.get("type")
    if kind not in ("auto", "any", "tool", "none"):
        raise ApiError(400, f"tool_choice.type must be auto, any, tool or none, got {kind!r}", param="tool_choice")
    if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
        raise ApiError(400, "tool_choice.disable_parallel_tool_use must be true or false", param="tool_choice")
    if not tools:
        if kind in ("any", "tool"):
            raise ApiError(400, f"tool_choice {kind!r} needs tools", param="tool_choice")
        return ToolPlan()
    specs = _tool_specs(tools, anthropic=True)
    parallel = not choice.get("disable_parallel_tool_use", False)
    if kind == "none":
        return ToolPlan("none", specs)
    if kind == "auto":
        return ToolPlan("auto", specs, parser=_auto_parser(settings), parallel=parallel)
    if kind == "any":
        return ToolPlan("required", specs, parallel=parallel)
    return _named(specs, choice.get("name"))  # "tool"


def _named(specs: list[ToolSpec], name: Any) -> ToolPlan:
    if not any(tool.name == name for tool in specs):
        raise ApiError(400, f"tool_choice names {name!r}, which is not among the tools ({', '.join(t.name for t in specs)})", param="tool_choice")
    return ToolPlan("named", specs, named=name)


def json_constrained(guide: GuidedDecodingParams | None) -> bool:
    """Whether a constraint makes the output pure JSON (so it holds no reasoning block)."""
    return guide is not None and guide.kind in ("json", "json_object")


def output_parser(plan: ToolPlan, settings: ServerSettings, guide: GuidedDecodingParams | None) -> OutputParser:
    """The parser of one choice of a request with this plan and constraint."""
    closes_json = guide is not None and guide.kind == "json_object"
    return OutputParser(plan, reasoning_parser(settings), json_constrained(guide), closes_json)


def reasoning_parser(settings: ServerSettings) -> ReasoningParser | None:
    return make_reasoning_parser(settings.reasoning_parser) if settings.reasoning_parser else None


@dataclass(slots=True)
class ParsedOutput:
    reasoning: str | None
    content: str
    tool_calls: list[ToolCall]


class OutputParser:
    """Reasoning, then tool calls, for one choice's text (whole or streamed).

    :param plan: the request's tool plan.
    :param reasoning: the server's reasoning parser (None: no reasoning separation).
    :param constrained: the output is JSON by grammar, so it holds no reasoning block.
    :param closes_json: the output is a ``json_object``: one cut by ``max_tokens`` is closed
        (``json_closer``) so its content parses.
    """

    def __init__(self, plan: ToolPlan, reasoning: ReasoningParser | None, constrained: bool, closes_json: bool = False) -> None:
        self.plan = plan
        self.closes_json = closes_json
        self._json_text = ""
        self.reasoning = None if constrained else reasoning
        self._reasoning_stream = ReasoningStream(self.reasoning) if self.reasoning is not None else None
        self._tool_stream = ToolCallStream(plan.parser) if plan.mode == "auto" and plan.parser is not None else None
        self._text = ""
        self._named_started = False

    def parse(self, text: str, truncated: bool = False) -> ParsedOutput:
        """A whole output (``truncated``: cut by ``max_tokens``)."""
        reasoning, content = (None, text) if self.reasoning is None else self.reasoning.extract(text)
        result = self.plan.parse(content, truncated)
        if self.closes_json and truncated and not result.tool_calls:
            result.content += closing_suffix(result.content) or ""
        return ParsedOutput(reasoning, result.content, result.tool_calls)

    def feed(self, delta: str) -> list[StreamEvent]:
        """Events a streamed text delta completes."""
        if not delta:
            return []
        pieces = self._reasoning_stream.feed(delta) if self._reasoning_stream is not None else [("content", delta)]
        if self.closes_json:
            self._json_text += "".join(text for kind, text in pieces if kind == "content")
        return self._content_events(pieces)

    def finish(self, truncated: bool = False) -> list[StreamEvent]:
        """Events held back until the output is complete (``truncated``: cut by ``max_tokens``)."""
        events = self._content_events(self._reasoning_stream.finish()) if self._reasoning_stream is not None else []
        if self._tool_stream is not None:
            events += self._tool_stream.finish(truncated)
        elif self.plan.mode == "required":
            result = _parse_required(self._text, truncated, self.plan.names)
            if result.tool_calls:
                events += [StreamEvent("tool_call", call.arguments, i, call) for i, call in enumerate(result.tool_calls)]
            elif result.content:
                events.append(StreamEvent("content", result.content))
        if self.closes_json and truncated:
            suffix = closing_suffix(self._json_text)
            if suffix:
                events.append(StreamEvent("content", suffix))
        return events

    def _content_events(self, pieces: list[tuple[str, str]]) -> list[StreamEvent]:
        events: list[StreamEvent] = []
        for kind, text in pieces:
            if kind == "reasoning":
                events.append(StreamEvent("reasoning", text))
            elif self._tool_stream is not None:
                events += self._tool_stream.feed(text)
            elif self.plan.mode == "named":
                if not self._named_started:
                    self._named_started = True
                    events.append(StreamEvent("tool_call", text, 0, ToolCall(self.plan.named or "", "")))
                else:
                    events.append(StreamEvent("arguments", text, 0))
            elif self.plan.mode == "required":
                self._text += text
            else:
                events.append(StreamEvent("content", text))
        return events


def template_message_tool_calls(tool_calls: list[Any]) -> list[dict[str, Any]]:
    """Assistant tool calls as chat templates expect them: arguments as a dict when they are JSON.

    :raises ValueError: a call, or its ``function``, that is not an object (the message names
        which, ``tool_calls[i]...``)."""
    result = []
    for index, call in enumerate(tool_calls):
        if not isinstance(call, dict):
            raise ValueError(f"tool_calls[{index}] must be an object, got {type(call).__name__}")
        function = call.get("function")
        if function is not None and not isinstance(function, dict):
            raise ValueError(f"tool_calls[{index}].function must be an object, got {type(function).__name__}")
        call = dict(call)
        function = dict(function or {})
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = strict_json.loads(arguments)
            except (ValueError, RecursionError):
                pass
        call["function"] = function
        result.append(call)
    return result
