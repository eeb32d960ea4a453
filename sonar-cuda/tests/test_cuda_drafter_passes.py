"""The work between two verify passes of a drafter in two launches (``DrafterPassChain``)
against the same work as separate device operations (``PassChain``), on random states:
passes that keep some, all or none of their drafts, stop tokens, the step's last rows,
``max_tokens``, passes that no longer run; and what the drafter reads after each (the rows
kept, the last token emitted and its position). On the GPU where present, else through
Triton's interpreter."""

from __future__ import annotations

import random

import pytest
import torch

from test_cuda_ngram_passes import BLOCK_SIZE, _rows, random_first_pass

from sonar.spec_decode.device_passes import PassChain
from sonar_cuda.kernels.drafter_passes import DrafterPassChain


def test_two_launches_between_passes_do_what_the_separate_operations_do(device: torch.device) -> None:
    rng = random.Random(0)
    capacity = 96
    for trial in range(60):
        k = rng.choice([1, 3, 4, 7])
        vocab, sequence, end, max_tokens, stops, block_row, first_drafts, inputs, greedy = random_first_pass(rng, k, capacity, device)
        outputs = []
        for cls in (PassChain, DrafterPassChain):
            chain = cls(capacity, k, 4, device)
            chain.begin(sequence, end, 0, max_tokens, stops, block_row, BLOCK_SIZE, first_drafts)
            rows = _rows(k + 1, device)
            seen = []
            chain.settle(greedy, inputs)
            for index in range(2):
                anchor, position = chain.anchor()
                seen.append([int(chain.kept_rows), int(anchor), int(position)])
                drafts = torch.randint(0, vocab, (k,), generator=torch.Generator().manual_seed(trial * 7 + index)).to(device)
                chain.lay_out(rows, drafts, k)
                # the target keeps a random prefix of the drafts laid out
                laid_out = rows.token_ids.clone()
                target = torch.roll(laid_out, -1)
                cut = (trial + index) % (k + 1)
                target[cut:] = (target[cut:] + 1) % vocab
                chain.settle(target, laid_out)
            anchor, position = chain.anchor()
            seen.append([int(chain.kept_rows), int(anchor), int(position)])
            done = chain.finish()
            outputs.append((done.read(), seen, [t.tolist() for t in (rows.token_ids, rows.positions, rows.slots, rows.seq_lens)],
                            chain.state.tolist(), chain.sequence[:capacity].tolist()))  # fmt: skip
        assert outputs[0] == outputs[1], (trial, sequence, k, end, max_tokens, stops)


@pytest.mark.parametrize("method, silent_head, lengths", [("dspark", False, (11,)), ("dflash", True, (13,)), ("dspark-confidence", True, (17,))])
def test_drafter_passes_queued_at_once_match_plain_decoding_and_the_host_loop(tmp_path, method, silent_head, lengths) -> None:
    """A drafter with three verify passes a step on the CUDA runner: a lone greedy request's
    passes are queued at once, the drafter drafting between them on the device; the same
    tokens as plain decoding, and the same steps, drafts and acceptance as the loop that
    reads each pass back, with ``max_tokens`` inside a step; after every step the drafter's
    context holds each position once, in order, and no block is leaked. A random DSpark
    drafter's drafts are rejected; with an all-zero LM head (shared by target and DFlash
    drafter) every token is token 0 and every draft is kept, so passes emit whole blocks; so
    too for a DSpark drafter without its Markov bias under confidence-scheduled verification
    (the policy's choices fixed: the first pass of a step verifies 2 of its 3 drafts), whose
    steps of passes are collected before the next is scheduled (how many rows they keep is
    known only then)."""
    from engine_helpers import InterpretedCudaPlatform, generate, use_tokenizer_folder_if_needed
    from safetensors.torch import load_file, save_file
    from sonar_cpu.platform import CpuPlatform
    from transformers import AutoConfig

    from sonar.config import EngineArgs
    from sonar.engine.llm_engine import LLMEngine
    from sonar.sampling_params import SamplingParams
    from sonar.spec_decode.dflash_checkpoint import save_dflash
    from sonar.spec_decode.dflash_model import DFlashDrafter
    from sonar.spec_decode.dflash_trainer import drafter_config_for, init_drafter
    from sonar_cuda.platform import CudaPlatform
    from sonar_models.testing import build_tiny_model

    use_tokenizer_folder_if_needed()
    path = build_tiny_model("llama", tmp_path / "llama")
    hf = AutoConfig.from_pretrained(path)
    method, _, verification = method.partition("-")
    drafter_config = drafter_config_for(hf, "deepspec", 4, 1, [-1, 0], hf.vocab_size - 1, markov_rank=8, markov_head_type="vanilla", confidence_head=True)
    if method == "dflash":
        drafter_config = drafter_config_for(hf, "zlab", 4, 1, [0], hf.vocab_size - 1)
    weights = load_file(str(path / "model.safetensors"))
    if silent_head:
        for name in ("lm_head.weight", "model.embed_tokens.weight"):  # tied or not: every logit 0
            if name in weights:
                weights[name] = torch.zeros_like(weights[name])
        save_file(weights, str(path / "model.safetensors"), metadata={"format": "pt"})
    lm_head = weights.get("lm_head.weight", weights["model.embed_tokens.weight"])
    drafter = init_drafter(DFlashDrafter(drafter_config), std=0.1, seed=0)
    if silent_head and drafter.markov_head is not None:  # no Markov bias either: every draft is token 0
        torch.nn.init.zeros_(drafter.markov_head.markov_w2.weight)
    save_dflash(drafter, tmp_path / "drafter", embedding=weights["model.embed_tokens.weight"], lm_head=lm_head)
    prompt = [(j * 7) % 97 + 100 for j in range(20)]
    kwargs = dict(dtype="float32", max_model_len=64, kv_cache_memory_bytes=1 << 20, skip_tokenizer_init=True)
    config = {"method": method, "model": str(tmp_path / "drafter"), "num_speculative_tokens": 3, "verification": verification or "fixed", "verify_passes": 3}
    platform = CudaPlatform if torch.cuda.is_available() else InterpretedCudaPlatform
    for max_tokens in lengths:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        (expected,), _ = generate(CpuPlatform, path, [prompt], params, **kwargs)
        runs = []
        for queued_at_once in (True, False):
            engine = LLMEngine(EngineArgs(model=str(path), speculative_config=config, **kwargs), platform=platform)
            runner = engine.core.executor.worker.model_runner
            proposer = runner.spec.proposer
            if verification:  # the policy's choices, fixed: every step drafts, a step's first pass verifies 2 of its 3 drafts
                policy = engine.core.scheduler.verification
                policy.worth_drafting = lambda num_sampling, base_tokens: True
                policy.choose = lambda confidences, rooms, *rest: [min(room, 2) for room in rooms]
            queued = []
            if queued_at_once:
                propose_pass = proposer.propose_pass
                proposer.propose_pass = lambda *args: queued.append(1) or propose_pass(*args)
            else:
                runner._chain_for = lambda step, batch, rows: None
            engine.add_request("0", {"prompt_token_ids": prompt}, params)
            done = None
            cache = proposer.cache
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.finished:
                        done = output.outputs[0].token_ids
                if "0" in runner.requests and "0" in cache.lengths:  # the context the device holds (a step may be in flight)
                    if torch.cuda.is_available():
                        torch.cuda.synchronize()
                    length = int(cache.device_lengths[cache.row_of("0")])
                    slots = torch.as_tensor(cache._host_slots("0", 0, length))
                    assert cache.positions[slots].tolist() == list(range(length))
            stats = engine.get_stats()
            runs.append((list(done), stats.num_steps, stats.spec_num_drafts, stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens))
            assert stats.num_free_blocks == stats.num_total_blocks
            if queued_at_once:
                assert queued and type(runner._pass_chain) is DrafterPassChain
        assert runs[0] == runs[1]
        assert runs[0][0] == list(expected.outputs[0].token_ids)
        if silent_head:  # every draft kept: a step of three passes emits up to 12 tokens (fixed-length)
            assert runs[0][0] == [0] * max_tokens and runs[0][4] == runs[0][3] > 0
            assert verification or runs[0][1] <= 4
