"""``sonar generate``: complete one or more prompts and print the results."""

from __future__ import annotations

import argparse
import sys

from sonar.cli.engine_args import add_engine_arguments, engine_args_from
from sonar.cli.sampling_args import add_sampling_arguments, sampling_params_from


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("generate", help="complete prompts with a model")
    add_engine_arguments(parser)
    parser.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for several)")
    add_sampling_arguments(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    from sonar.entrypoints.llm import LLM

    print("loading model...", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args_from(args))
    params = sampling_params_from(args)
    if len(args.prompt) == 1:
        from sonar.cli.chat import stream_completion

        stream_completion(llm, {"prompt": args.prompt[0]}, params)
        return 0
    for output in llm.generate(args.prompt, params, use_tqdm=sys.stderr.isatty()):
        print(f"--- {output.prompt!r}")
        print(output.outputs[0].text)
    return 0
