"""``sonar train-drafter``: train a drafter for a target model by self-distillation.

The target answers prompts (a JSON-lines file, or questions it writes itself) with Sonar's
engine; its hidden states and next-token distributions on its own answers are the training
data. ``--method eagle3`` (the default) trains an EAGLE-3 head with its training-time test and
saves the published EAGLE-3 layout; ``--method dflash`` / ``dspark`` train a block drafter
(``sonar.spec_decode.dflash_trainer``) and save DeepSpec's layout (``--layout zlab``: z-lab's,
DFlash only). ``speculative_config={"method": METHOD, "model": OUTPUT}`` loads the result.
"""

from __future__ import annotations

import argparse
import random
import sys
import time

from sonar.cli.engine_args import add_engine_arguments, engine_args_from

DEFAULT_DRAFT_VOCAB_SIZE = 4096
METHODS = ("eagle3", "dflash", "dspark")
DEFAULT_MARKOV_RANK = 256
# short self-distillation runs: block drafters held out 2.06 at 1e-3 against 1.94 at 5e-4 and 1.90 at 2e-3 (docs/benchmarks.md)
DEFAULT_LR = {"eagle3": 5e-4, "dflash": 1e-3, "dspark": 1e-3}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser("train-drafter", help="train an EAGLE-3, DFlash or DSpark drafter for a model on its own generations")
    add_engine_arguments(parser)
    group = parser.add_argument_group("drafter training")
    group.add_argument("--method", choices=METHODS, default="eagle3", help="the drafter to train (default: eagle3)")
    group.add_argument("--prompts", default=None, metavar="FILE", help="JSON lines with a turns/prompt/text field (default: the target writes its own)")
    group.add_argument("--num-prompts", type=int, default=200, help="prompts to answer, drawn at random (--seed) from --prompts (default: 200); to hold prompts out, leave them out of the file")
    group.add_argument("--max-tokens", type=int, default=128, help="tokens per answer (default: 128)")
    group.add_argument("--temperature", type=float, default=0.0, help="of the target's answers (default: 0, greedy)")
    group.add_argument("--samples-per-prompt", type=int, default=1, help="answers per training prompt: the first at --temperature, the others sampled at --sample-temperature, each with its own seed (default: 1); held-out prompts keep their first answer only")
    group.add_argument("--sample-temperature", type=float, default=0.8, help="of the extra answers of --samples-per-prompt (default: 0.8)")
    group.add_argument("--epochs", type=int, default=2, help="passes over the training data (default: 2)")
    group.add_argument("--lr", type=float, default=None, help=f"AdamW learning rate (default: {DEFAULT_LR['eagle3']:g} for eagle3, {DEFAULT_LR['dspark']:g} for dflash and dspark)")
    group.add_argument("--batch-size", type=int, default=8, help="sequences per optimizer step (default: 8)")
    group.add_argument("--ttt-steps", type=int, default=3, help="eagle3: training-time-test steps (default: 3)")
    group.add_argument("--draft-vocab-size", type=int, default=DEFAULT_DRAFT_VOCAB_SIZE, help=f"eagle3: the head's vocabulary, the most frequent target tokens (default: {DEFAULT_DRAFT_VOCAB_SIZE})")
    block = parser.add_argument_group("dflash / dspark drafters")
    block.add_argument("--layout", choices=("deepspec", "zlab"), default="deepspec", help="checkpoint layout written (default: deepspec; zlab for dflash only)")
    block.add_argument("--draft-block-size", type=int, default=7, help="slots per drafted block (default: 7; deepspec drafts that many tokens, zlab one fewer)")
    block.add_argument("--num-draft-layers", type=int, default=3, help="draft layers (default: 3)")
    block.add_argument("--target-layer-ids", default=None, metavar="IDS", help="comma-separated target layers read, -1 the embeddings (default: spread evenly, one per draft layer)")
    block.add_argument("--mask-token-id", type=int, default=None, help="the mask slots' token (default: the first id past the tokenizer's, else the last id)")
    block.add_argument("--markov-rank", type=int, default=None, help="dspark: the Markov head's rank (default: 256; 0 for dflash)")
    block.add_argument("--markov-head-type", choices=("vanilla", "gated", "rnn"), default="vanilla", help="dspark: the Markov head (default: vanilla)")
    block.add_argument("--num-anchors", type=int, default=64, help="blocks per sequence and step (default: 64)")
    block.add_argument("--loss-decay-gamma", type=float, default=4.0, help="slot j's loss weighs exp(-j / gamma) (default: 4)")
    group.add_argument("--save-answers", default=None, metavar="FILE", help="also write the target's answers (token ids, JSON) here, for --answers")
    group.add_argument("--answers", default=None, metavar="FILE", help="train on the answers --save-answers wrote (the same held-out ones) instead of generating them: several drafters on the same data")
    group.add_argument("--held-out", type=float, default=0.1, help="fraction of answers kept out of training to measure agreement (default: 0.1)")
    group.add_argument("--output", required=True, metavar="DIR", help="where the EAGLE-3 checkpoint folder is written")
    group.add_argument("--device", default=None, help="torch device the head trains on (default: cuda where available, else cpu)")
    parser.set_defaults(func=run)
    return parser


def _check(args: argparse.Namespace) -> str | None:
    if args.lr is not None and not args.lr > 0:
        return f"--lr must be > 0, got {args.lr}"
    if args.num_prompts < 2:
        return "--num-prompts must be at least 2 (one answer is held out)"
    if args.max_tokens < 2:
        return "--max-tokens must be at least 2"
    if args.draft_vocab_size < 1:
        return "--draft-vocab-size must be >= 1"
    if args.samples_per_prompt < 1:
        return f"--samples-per-prompt must be at least 1, got {args.samples_per_prompt}"
    if args.samples_per_prompt > 1 and not args.sample_temperature > 0:
        return f"--sample-temperature must be > 0 (extra greedy answers would repeat the first), got {args.sample_temperature}"
    if not 0 < args.held_out < 1:
        return "--held-out must be between 0 and 1"
    if args.method == "dspark" and args.layout != "deepspec":
        return "--method dspark saves DeepSpec's layout only (--layout deepspec)"
    if args.method != "eagle3" and args.draft_block_size < 2:
        return "--draft-block-size must be at least 2"
    if args.method != "eagle3" and (args.num_draft_layers < 1 or args.num_anchors < 1):
        return "--num-draft-layers and --num-anchors must be >= 1"
    if args.answers and args.save_answers:
        return "--answers and --save-answers exclude each other (the file already holds the answers)"
    if args.target_layer_ids is not None:
        try:
            [int(i) for i in args.target_layer_ids.split(",")]
        except ValueError:
            return f"--target-layer-ids must be comma-separated integers, got {args.target_layer_ids!r}"
    return None


def run(args: argparse.Namespace) -> int:
    import torch

    from sonar.entrypoints.llm import LLM
    from sonar.spec_decode import eagle3_data as data

    problem = _check(args)
    if problem:
        print(f"sonar train-drafter: {problem}", file=sys.stderr)
        return 2
    prompts = None
    if args.prompts:
        try:
            prompts = data.read_prompts(args.prompts)
        except (OSError, ValueError) as error:
            print(f"sonar train-drafter: {error}", file=sys.stderr)
            return 2
    if args.lr is None:
        args.lr = DEFAULT_LR[args.method]
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    seed = args.seed if args.seed is not None else 0
    tty = sys.stderr.isatty()
    started = time.perf_counter()
    print("loading the target...", file=sys.stderr, flush=True)
    llm = LLM.from_engine_args(engine_args_from(args))
    tokenizer = llm.get_tokenizer()
    runner = data.model_runner_of(llm)
    if args.answers:
        try:
            model, sequences, num_held_out = data.load_answers(args.answers, runner.model_config.vocab_size)
        except (OSError, ValueError) as error:
            print(f"sonar train-drafter: {error}", file=sys.stderr)
            return 2
        if model and model != llm.llm_engine.config.served_name:
            print(f"warning: {args.answers} holds the answers of {model}", file=sys.stderr, flush=True)
        print(f"{len(sequences)} answers read from {args.answers}, the first {num_held_out} held out", file=sys.stderr, flush=True)
        return _train(args, runner, tokenizer, sequences, num_held_out, device, seed, started)
    rng = random.Random(seed)
    if prompts is None:
        print(f"the target writes {args.num_prompts} prompts...", file=sys.stderr, flush=True)
        prompts = data.self_written_prompts(llm, args.num_prompts, seed)
    else:
        rng.shuffle(prompts)
        prompts = prompts[: args.num_prompts]
    prompt_ids = [data.chat_prompt_ids(tokenizer, text) for text in prompts]
    print(f"the target answers {len(prompt_ids)} prompts (at most {args.max_tokens} tokens each)...", file=sys.stderr, flush=True)
    responses = data.generate_responses(llm, prompt_ids, args.max_tokens, args.temperature, tty)
    answered = [(p, r) for p, r in zip(prompt_ids, responses) if len(r) >= 2]
    if len(answered) < 2:
        print("sonar train-drafter: the target answered fewer than 2 prompts with 2 tokens or more", file=sys.stderr)
        return 1
    # held out by prompt: the first answers of the first prompts; the others train, with their extra answers
    num_held_out = max(1, round(len(answered) * args.held_out))
    sequences = list(answered)
    if args.samples_per_prompt > 1:
        training_prompts = [p for p, _ in answered[num_held_out:]]
        count = args.samples_per_prompt - 1
        print(f"the target answers them {count} more time(s) (temperature {args.sample_temperature:g})...", file=sys.stderr, flush=True)
        extra = data.generate_samples(llm, training_prompts, args.max_tokens, args.sample_temperature, count, seed, tty)
        sequences += [(p, r) for p, answers in zip(training_prompts, extra) for r in answers if len(r) >= 2]
    if args.save_answers:
        data.save_answers(args.save_answers, llm.llm_engine.config.served_name, sequences, num_held_out)
        print(f"wrote the {len(sequences)} answers to {args.save_answers}", file=sys.stderr, flush=True)
    return _train(args, runner, tokenizer, sequences, num_held_out, device, seed, started)


def _train(args: argparse.Namespace, runner, tokenizer, sequences, num_held_out: int, device: str, seed: int, started: float) -> int:
    if args.method == "eagle3":
        return _train_eagle3(args, runner, sequences, num_held_out, device, seed, started)
    return _train_block_drafter(args, runner, tokenizer, sequences, num_held_out, device, seed, started)


def _train_eagle3(args: argparse.Namespace, runner, sequences, num_held_out: int, device: str, seed: int, started: float) -> int:
    import torch

    from sonar.spec_decode import eagle3_data as data
    from sonar.spec_decode.eagle3_checkpoint import save_eagle3
    from sonar.spec_decode.eagle3_head import Eagle3Head
    from sonar.spec_decode.eagle3_trainer import TrainOptions, evaluate_head, head_config_for, train_head

    target = runner.model
    hf_config = runner.model_config.hf_config
    aux = data._unwrapped(target).aux_hidden_states
    aux_ids = list(aux.default_layer_ids())
    print(f"reading the target's states (auxiliary layers {aux_ids})...", file=sys.stderr, flush=True)
    samples = _samples(runner, sequences, aux_ids)
    vocab_size = runner.model_config.vocab_size
    draft_vocab = min(args.draft_vocab_size, vocab_size)
    target_ids, d2t, t2d = data.draft_vocabulary(samples, vocab_size, draft_vocab)
    head_rows = data.target_head_rows(data._unwrapped(target), target_ids, hf_config.hidden_size)

    torch.manual_seed(seed)
    head = Eagle3Head(head_config_for(hf_config, draft_vocab, aux_ids))
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        head.lm_head.weight.copy_(head_rows)  # starts as the target's own head over the draft vocabulary
    head = head.to(device)
    embed = _host_embedding(target, device)
    held_out, training = samples[:num_held_out], samples[num_held_out:]
    options = TrainOptions(args.epochs, args.lr, args.batch_size, args.ttt_steps, seed=seed, device=device, progress=True)
    num_tokens = sum(len(s.token_ids) for s in training)
    print(f"training on {len(training)} answers ({num_tokens} tokens), {num_held_out} held out, on {device}...", file=sys.stderr, flush=True)
    result = train_head(head, training, embed, head_rows, options)
    evaluation = evaluate_head(head, held_out, embed, head_rows, options)
    save_eagle3(head, args.output)
    print(f"train loss by epoch: {', '.join(f'{loss:.3f}' for loss in result.epoch_losses)}")
    print(f"held-out loss {evaluation.loss:.3f} over {evaluation.num_positions} positions")
    print(f"held-out top-1 agreement by draft position: {', '.join(f'{rate:.3f}' for rate in evaluation.top1)}")
    print(f"implied mean acceptance length at k={len(evaluation.top1)}: {evaluation.acceptance_length:.2f}")
    print(f"saved the EAGLE-3 head to {args.output} ({time.perf_counter() - started:.0f} s in all)")
    print(f'use it: --speculative-config \'{{"method": "eagle3", "model": "{args.output}", "num_speculative_tokens": 3}}\'')
    return 0


def _samples(runner, sequences, aux_ids: list[int]):
    """The target's states of every prompt-and-answer, kept on the host in bfloat16."""
    import torch

    from sonar.spec_decode import eagle3_data as data

    full = [p + r for p, r in sequences]
    return [
        data.Sample(tokens, len(p), aux_states.to(torch.bfloat16), final.to(torch.bfloat16))
        for tokens, (p, _), (aux_states, final) in zip(full, sequences, data.target_states(runner, full, aux_ids))
    ]


def _train_block_drafter(args: argparse.Namespace, runner, tokenizer, sequences, num_held_out: int, device: str, seed: int, started: float) -> int:
    import torch

    from sonar.spec_decode import eagle3_data as data
    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_config import spread_target_layer_ids
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import (
        DFlashTrainOptions, drafter_config_for, evaluate_drafter, init_drafter, target_greedy_ids, train_drafter,
    )  # fmt: skip

    target = data._unwrapped(runner.model)
    hf_config = runner.model_config.hf_config
    num_layers = hf_config.num_hidden_layers
    if args.target_layer_ids is not None:
        layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    else:
        layer_ids = sorted({min(i, num_layers - 2) for i in spread_target_layer_ids(num_layers, args.num_draft_layers)})
    if not layer_ids or layer_ids[0] < -1 or layer_ids[-1] > num_layers - 2 or layer_ids != sorted(set(layer_ids)):
        print(f"sonar train-drafter: --target-layer-ids {layer_ids} must increase within -1..{num_layers - 2} (the target has {num_layers} layers)", file=sys.stderr)
        return 2
    vocab_size = runner.model_config.vocab_size
    mask = args.mask_token_id
    if mask is None:
        mask = len(tokenizer) if len(tokenizer) < vocab_size else vocab_size - 1
    if not 0 <= mask < vocab_size:
        print(f"sonar train-drafter: --mask-token-id {mask} is outside the vocabulary of {vocab_size}", file=sys.stderr)
        return 2
    dspark = args.method == "dspark"
    rank = (DEFAULT_MARKOV_RANK if args.markov_rank is None else args.markov_rank) if dspark else 0
    config = drafter_config_for(
        hf_config, args.layout, args.draft_block_size, args.num_draft_layers, layer_ids, mask,
        markov_rank=rank, markov_head_type=args.markov_head_type, confidence_head=dspark, num_anchors=args.num_anchors,
    )  # fmt: skip
    print(f"reading the target's states (layers {layer_ids})...", file=sys.stderr, flush=True)
    samples = _samples(runner, sequences, list(config.aux_layer_ids))
    head_weight = data.target_head_rows(target, torch.arange(vocab_size), hf_config.hidden_size).clone()  # [vocab, hidden], a normal tensor
    greedy = target_greedy_ids(samples, head_weight, torch.device(device))
    drafter = init_drafter(DFlashDrafter(config), seed=seed).to(device)
    embed = _host_embedding(target, device)
    options = DFlashTrainOptions(
        args.epochs, args.lr, args.batch_size, args.num_anchors, args.loss_decay_gamma, seed=seed, device=device, progress=True
    )
    held_out, training = list(range(num_held_out)), list(range(num_held_out, len(samples)))
    pick = lambda items, rows: [items[i] for i in rows]  # noqa: E731
    num_tokens = sum(len(samples[i].token_ids) for i in training)
    print(f"training a {args.method} drafter on {len(training)} answers ({num_tokens} tokens), {num_held_out} held out, on {device}...", file=sys.stderr, flush=True)
    before = evaluate_drafter(drafter, pick(samples, held_out), pick(greedy, held_out), embed, head_weight, options)
    result = train_drafter(drafter, pick(samples, training), pick(greedy, training), embed, head_weight, options)
    evaluation = evaluate_drafter(drafter, pick(samples, held_out), pick(greedy, held_out), embed, head_weight, options)
    save_dflash(drafter, args.output, embedding=embed.weight, lm_head=head_weight)
    print(f"train loss by epoch: {', '.join(f'{loss:.3f}' for loss in result.epoch_losses)}")
    print(f"held-out loss {evaluation.loss:.3f} over {evaluation.num_blocks} blocks (untrained: {before.loss:.3f})")
    print(f"held-out top-1 agreement by draft position: {', '.join(f'{rate:.3f}' for rate in evaluation.top1)}")
    print(f"held-out mean acceptance length at k={config.num_drafts}: {evaluation.acceptance_length:.2f} (untrained: {before.acceptance_length:.2f})")
    if evaluation.predicted_survival is not None:
        pairs = ", ".join(f"{p:.2f}/{o:.2f}" for p, o in zip(evaluation.predicted_survival, evaluation.observed_survival))
        print(f"held-out prefix survival by draft position, predicted/observed: {pairs}")
    print(f"saved the {args.method} drafter ({config.layout} layout) to {args.output} ({time.perf_counter() - started:.0f} s in all)")
    print(f'use it: --speculative-config \'{{"method": "{args.method}", "model": "{args.output}", "num_speculative_tokens": {config.num_drafts}}}\'')
    return 0


def _host_embedding(target, device: str):
    """A copy of the target's token embedding on the training device (never trained)."""
    import torch

    from sonar.spec_decode.eagle3 import target_embedding

    weight = target_embedding(target).weight.detach().float().to(device)
    return torch.nn.Embedding.from_pretrained(weight, freeze=True)
