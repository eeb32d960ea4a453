"""``sonar chat``: an interactive chat in the terminal, streaming as tokens come."""

from __future__ import annotations

import argparse
import sys
import uuid
from typing import Any

from sonar.cli.engine_args import add_engine_arguments, engine_args_from
from sonar.cli.sampling_args import add_sampling_arguments, sampling_params_from
from sonar.sampling_params import SamplingParams


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("chat", help="chat with a model in the terminal")
    add_engine_arguments(parser)
    parser.add_argument("--system", default=None, help="system prompt")
    add_sampling_arguments(parser, max_tokens=512)
    parser.set_defaults(func=run)
    return parser


def stream_completion(llm: Any, prompt: Any, params: SamplingParams, out=sys.stdout) -> str:
    """Generate one completion, writing the text to ``out`` as it is produced."""
    engine = llm.llm_engine
    request_id = f"cli-{uuid.uuid4().hex}"
    engine.add_request(request_id, prompt, params)
    printed = 0
    text = ""
    try:
        while engine.has_unfinished_requests():
            for output in engine.step():
                if output.request_id != request_id:
                    continue
                text = output.outputs[0].text
                out.write(text[printed:])
                out.flush()
                printed = len(text)
    except KeyboardInterrupt:
        engine.abort_request([request_id])
    out.write("\n")
    out.flush()
    return text


def run(args: argparse.Namespace) -> int:
    from sonar.entrypoints.llm import LLM

    print("loading model...", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args_from(args))
    params = sampling_params_from(args)
    messages: list[dict[str, str]] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = sys.stdin.isatty()
    if interactive:
        print("Type a message and press Enter; /reset clears the history, /exit or Ctrl-D quits.", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except (EOFError, KeyboardInterrupt):
            print(file=sys.stderr)
            return 0
        line = line.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return 0
        if line == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        prompt = {"prompt_token_ids": llm.apply_chat_template(messages)}
        reply = stream_completion(llm, prompt, params)
        messages.append({"role": "assistant", "content": reply})
