"""Block-drafter training recipes compared on one cached data set: held-out acceptance.

    # once: the target answers the prompts (greedy) and its states are read and cached
    python sonar-core/benchmarks/drafter_recipes.py collect --prompts gsm8k.jsonl --max-tokens 192 --cache states.pt
    # then each recipe on the same answers (the first --held-out answers are never trained on)
    python sonar-core/benchmarks/drafter_recipes.py train --cache states.pt --train 400 --lr 1e-3 --tag lr1e-3
    python sonar-core/benchmarks/drafter_recipes.py train --cache states.pt --train 400 --init-from-target 27,28,29
    # sampled answers of the training prompts as extra data (2 per prompt, temperature 0.8)
    python sonar-core/benchmarks/drafter_recipes.py collect --prompts gsm8k.jsonl --skip 100 --limit 400 --temperature 0.8 --samples 2 --cache sampled.pt
    python sonar-core/benchmarks/drafter_recipes.py train --cache states.pt --train 400 --extra-cache sampled.pt

``sonar train-drafter`` generates and reads the data anew on every run; caching it once lets
recipes be compared on identical answers and held-out blocks. The target is the embedded
SmolLM2-135M-Instruct unless ``--model`` names another (its GGUF dequantized, float32 on the
CPU). ``train`` prints one JSON line: the train loss per epoch, the held-out loss, the top-1
agreement per draft slot (given the slots before it were right) and the held-out mean
acceptance length at ``k = block size`` under greedy verification.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from sonar import SamplingParams
from sonar.spec_decode import dflash_trainer as trainer
from sonar.spec_decode import eagle3_data as data
from sonar.spec_decode.dflash_model import DFlashDrafter

CACHED_LAYERS = "1,7,14,21,27"  # the target layers whose states are kept by default (drafters pick among them)


def collect(args: argparse.Namespace) -> None:
    from sonar import LLM
    from sonar.config import default_model_path
    from sonar.spec_decode.eagle3 import target_embedding

    started = time.perf_counter()
    llm = LLM(args.model or default_model_path(), quantization="unquantized", dtype=args.dtype, max_model_len=1024, max_num_seqs=128, enable_prefix_caching=False)
    tokenizer = llm.get_tokenizer()
    prompt_ids = [data.chat_prompt_ids(tokenizer, text) for path in args.prompts for text in data.read_prompts(path)]
    prompt_ids = prompt_ids[args.skip : None if args.limit is None else args.skip + args.limit]
    if args.temperature > 0:  # --samples answers per prompt, each drawn with its own seed
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=1 + s) for s in range(args.samples)]
        prompt_ids = [p for p in prompt_ids for _ in range(args.samples)]
        outputs = llm.generate([{"prompt_token_ids": p} for p in prompt_ids], params * (len(prompt_ids) // args.samples), use_tqdm=sys.stderr.isatty())
        responses = [list(o.outputs[0].token_ids) for o in outputs]
    else:
        responses = data.generate_responses(llm, prompt_ids, args.max_tokens, 0.0, use_tqdm=sys.stderr.isatty())
    print(f"{len(prompt_ids)} answers, {sum(map(len, responses))} tokens in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    runner = data.model_runner_of(llm)
    layers = [int(i) for i in args.layers.split(",")]
    sequences = [p + r for p, r in zip(prompt_ids, responses)]
    samples = [
        (tokens, len(p), aux.to(torch.bfloat16), final.to(torch.bfloat16))
        for tokens, p, (aux, final) in zip(sequences, prompt_ids, data.target_states(runner, sequences, layers))
    ]
    core = data._unwrapped(runner.model)
    hf_config = runner.model_config.hf_config
    head = data.target_head_rows(core, torch.arange(runner.model_config.vocab_size), hf_config.hidden_size)
    torch.save(
        {"samples": samples, "layers": layers, "head": head, "embed": target_embedding(core).weight.detach().float().clone(),
         "hf_config": hf_config.to_dict(), "target_layers": _target_layers(core) if args.keep_layers else None},
        args.cache,
    )  # fmt: skip
    print(f"cached in {time.perf_counter() - started:.0f} s", file=sys.stderr)


def _target_layers(core: torch.nn.Module) -> dict:
    """Each target layer's weights under the drafter's names (for ``--init-from-target``)."""
    model = getattr(core, "model", core)

    def weight(module: torch.nn.Module) -> torch.Tensor:
        return module.weight.detach().float().clone()

    layers: dict = {"norm": weight(model.norm)}
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        qkv = weight(attn.qkv_proj)
        q_rows = attn.num_heads * attn.head_dim
        q, k, v = qkv.split([q_rows, (qkv.shape[0] - q_rows) // 2, (qkv.shape[0] - q_rows) // 2])
        gate, up = weight(layer.mlp.gate_up_proj).chunk(2)
        layers[i] = {
            "self_attn.q_proj.weight": q, "self_attn.k_proj.weight": k, "self_attn.v_proj.weight": v,
            "self_attn.o_proj.weight": weight(attn.o_proj), "mlp.gate_proj.weight": gate, "mlp.up_proj.weight": up,
            "mlp.down_proj.weight": weight(layer.mlp.down_proj), "input_layernorm.weight": weight(layer.input_layernorm),
            "post_attention_layernorm.weight": weight(layer.post_attention_layernorm),
        }  # fmt: skip
    return layers


def train(args: argparse.Namespace) -> None:
    from transformers import LlamaConfig

    cache = torch.load(args.cache, weights_only=True)  # tensors, lists and plain values only: nothing is unpickled into code
    layer_ids = [int(i) for i in args.target_layer_ids.split(",")]
    hidden = cache["head"].shape[1]
    columns = torch.cat([torch.arange(hidden) + cache["layers"].index(i) * hidden for i in layer_ids])
    samples = [data.Sample(tokens, n, aux[:, columns].contiguous(), final) for tokens, n, aux, final in cache["samples"]]
    extra = [
        data.Sample(tokens, n, aux[:, columns].contiguous(), final)
        for path in args.extra_cache for tokens, n, aux, final in torch.load(path, weights_only=True)["samples"]
    ]  # fmt: skip
    hf_config = LlamaConfig(**{k: v for k, v in cache["hf_config"].items() if k != "architectures"})
    head, embed = cache["head"], torch.nn.Embedding.from_pretrained(cache["embed"], freeze=True)
    config = trainer.drafter_config_for(
        hf_config, "deepspec", args.block_size, args.num_draft_layers, layer_ids, hf_config.vocab_size - 1,
        markov_rank=args.markov_rank, markov_head_type="vanilla", confidence_head=args.markov_rank > 0, num_anchors=args.num_anchors,
    )  # fmt: skip
    drafter = trainer.init_drafter(DFlashDrafter(config), seed=args.seed)
    if args.init_from_target:
        _copy_target_layers(drafter, cache["target_layers"], [int(i) for i in args.init_from_target.split(",")])
    held_out, training = range(args.held_out), range(args.held_out, min(len(samples), args.held_out + args.train))
    pick = lambda items, rows: [items[i] for i in rows]  # noqa: E731
    samples = pick(samples, held_out) + pick(samples, training) + extra  # the extra caches' answers are all trained on
    training = range(len(held_out), len(samples))
    greedy = trainer.target_greedy_ids(samples, head, torch.device("cpu"))
    options = trainer.DFlashTrainOptions(args.epochs, args.lr, args.batch_size, args.num_anchors, args.loss_decay_gamma, seed=args.seed, progress=sys.stderr.isatty())
    started = time.perf_counter()
    result = trainer.train_drafter(drafter, pick(samples, training), pick(greedy, training), embed, head, options)
    seconds = time.perf_counter() - started
    evaluation = trainer.evaluate_drafter(drafter, pick(samples, held_out), pick(greedy, held_out), embed, head, options)
    print(json.dumps({
        "tag": args.tag, "answers": len(training), "epochs": args.epochs, "lr": args.lr, "target_layer_ids": layer_ids,
        "train_s": round(seconds), "train_loss": [round(x, 3) for x in result.epoch_losses], "held_out_loss": round(evaluation.loss, 3),
        "top1": [round(x, 3) for x in evaluation.top1], "acceptance_length": round(evaluation.acceptance_length, 3),
    }), flush=True)  # fmt: skip
    if args.save:
        from sonar.spec_decode.dflash_checkpoint import save_dflash

        save_dflash(drafter, args.save, embedding=cache["embed"], lm_head=head)


def _copy_target_layers(drafter: DFlashDrafter, target_layers: dict | None, ids: list[int]) -> None:
    if target_layers is None:
        raise SystemExit("--init-from-target needs a cache collected with --keep-layers")
    with torch.no_grad():
        for layer, source in zip(drafter.layers, ids):
            for name, weight in target_layers[source].items():
                layer.get_parameter(name).copy_(weight)
        drafter.norm.weight.copy_(target_layers["norm"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("collect")
    c.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    c.add_argument("--prompts", nargs="+", required=True)
    c.add_argument("--max-tokens", type=int, default=192)
    c.add_argument("--dtype", default="float32")
    c.add_argument("--layers", default=CACHED_LAYERS, help=f"target layers whose states are cached (default: {CACHED_LAYERS})")
    c.add_argument("--keep-layers", action="store_true", help="also keep the target's layer weights (--init-from-target)")
    c.add_argument("--cache", required=True)
    c.add_argument("--skip", type=int, default=0, help="leave out the first prompts")
    c.add_argument("--limit", type=int, default=None, help="at most this many prompts (after --skip)")
    c.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled answers instead of greedy ones")
    c.add_argument("--samples", type=int, default=1, help="answers per prompt when sampling (seeds 1, 2, ...)")
    t = sub.add_parser("train")
    t.add_argument("--cache", required=True)
    t.add_argument("--train", type=int, default=400, help="answers trained on (after the held-out ones)")
    t.add_argument("--held-out", type=int, default=100)
    t.add_argument("--extra-cache", nargs="*", default=[], help="caches whose answers are all trained on as well (sampled answers)")
    t.add_argument("--epochs", type=int, default=3)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--batch-size", type=int, default=8)
    t.add_argument("--num-anchors", type=int, default=64)
    t.add_argument("--loss-decay-gamma", type=float, default=4.0)
    t.add_argument("--block-size", type=int, default=7)
    t.add_argument("--num-draft-layers", type=int, default=3)
    t.add_argument("--target-layer-ids", default="1,14,27", help="among the cached layers")
    t.add_argument("--markov-rank", type=int, default=256, help="0: DFlash")
    t.add_argument("--init-from-target", default="", help="target layer ids whose weights start the draft layers")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--tag", default="")
    t.add_argument("--save", default=None, help="write the drafter (DeepSpec layout) here")
    args = parser.parse_args()
    if args.command == "collect":
        collect(args)
    else:
        train(args)


if __name__ == "__main__":
    main()
