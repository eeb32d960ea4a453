"""``LLM.beam_search`` against transformers' beam search on the same weights: the same beams,
in the same order, with the same scores."""

from __future__ import annotations

import pytest
import torch

from sonar import LLM, BeamSearchParams

KV_BYTES = 1 << 24


@pytest.mark.parametrize("beam_width", [2, 4])
def test_beams_equal_transformers_beam_search(tiny_model_dir, beam_width: int) -> None:
    from transformers import AutoModelForCausalLM

    path = str(tiny_model_dir("llama"))
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory_bytes=KV_BYTES)
    prompts = [[11, 12, 13, 14, 15], list(range(300, 340))]
    max_tokens = 6
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], BeamSearchParams(beam_width=beam_width, max_tokens=max_tokens, ignore_eos=True))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    for prompt, output in zip(prompts, outputs):
        with torch.inference_mode():
            hf = model.generate(
                torch.tensor([prompt]), num_beams=beam_width, num_return_sequences=beam_width, max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                do_sample=False, early_stopping=True, length_penalty=1.0, output_scores=True, return_dict_in_generate=True,
            )
        want = [row.tolist() for row in hf.sequences]
        assert [beam.tokens for beam in output.sequences] == want
        # transformers scores by generated length; ours by the whole sequence's, as vLLM: same order, scaled
        got = [beam.cum_logprob / max_tokens for beam in output.sequences]
        assert got == pytest.approx(hf.sequences_scores.tolist(), abs=1e-4)
        assert all(beam.finish_reason == "length" and len(beam.logprobs) == max_tokens for beam in output.sequences)
        assert output.sequences[0].text == llm.get_tokenizer().decode(want[0])


def test_beam_width_is_bounded_by_max_logprobs(tiny_model_dir) -> None:
    llm = LLM(str(tiny_model_dir("llama")), max_model_len=64, kv_cache_memory_bytes=KV_BYTES)
    with pytest.raises(ValueError, match="beam_width=11 ranks 22 tokens a step, more than max_logprobs=20"):
        llm.beam_search([[1, 2, 3]], BeamSearchParams(beam_width=11, max_tokens=2))
    with pytest.raises(ValueError, match="beam_width must be an integer >= 1"):
        BeamSearchParams(beam_width=0, max_tokens=2)
    # a beam that fills the context stops there
    out = llm.beam_search([list(range(100, 160))], BeamSearchParams(beam_width=2, max_tokens=10, ignore_eos=True))[0]
    assert all(len(beam.tokens) == 64 for beam in out.sequences)


def test_a_beam_that_ends_in_eos_is_complete_and_ranked_by_its_length() -> None:
    from sonar.beam_search import beam_search
    from sonar.outputs import CompletionOutput, Logprob, RequestOutput

    EOS = 2
    # next-token log-probabilities by the last token: after 7, EOS is likeliest; then 8, 9
    table = {7: {EOS: -0.1, 8: -0.5, 9: -3.0}, 8: {8: -0.2, 9: -0.4, EOS: -5.0}, 9: {9: -0.3, 8: -0.6, EOS: -4.0}}

    def generate(batch, params):
        assert params.logprobs == 4 and params.max_tokens == 1
        outputs = []
        for item in batch:
            top = {t: Logprob(v) for t, v in table[item["prompt_token_ids"][-1]].items()}
            outputs.append(RequestOutput("x", None, item["prompt_token_ids"], None, [CompletionOutput(0, "", [0], None, [top])], True))
        return outputs

    from sonar import BeamSearchParams

    out = beam_search(generate, [[5, 7]], BeamSearchParams(beam_width=2, max_tokens=3), {EOS}, max_model_len=100)[0]
    first = out.sequences[0]
    assert first.tokens == [5, 7, EOS] and first.finish_reason == "stop" and first.stop_reason == EOS
    assert first.cum_logprob == pytest.approx(-0.1)  # -0.1 over 2 tokens (EOS not counted) beats the longer beams
    assert out.sequences[1].tokens == [5, 7, 8, 8, 8] and out.sequences[1].finish_reason == "length"
    ignored = beam_search(generate, [[5, 7]], BeamSearchParams(beam_width=2, max_tokens=1, ignore_eos=True), {EOS}, max_model_len=100)[0]
    assert [beam.tokens for beam in ignored.sequences] == [[5, 7, EOS], [5, 7, 8]]  # EOS kept live, not completed
    assert ignored.sequences[0].finish_reason == "length"


def test_a_length_penalty_far_from_zero_ranks_beams_and_a_non_finite_one_is_refused() -> None:
    """A penalty whose power leaves the floats (``length ** 1e308``) still gives finite scores,
    where it raised OverflowError or ZeroDivisionError (a 500 on the server); NaN and infinity
    are refused as the parameters are made."""
    import math

    from sonar import BeamSearchParams
    from sonar.beam_search import BeamSearchSequence, beam_score

    beams = [BeamSearchSequence([1, 2], cum_logprob=-1.0), BeamSearchSequence([1, 2, 3, 4, 5], cum_logprob=-2.0)]
    for penalty in (1e308, -1e308, 800.0, -800.0):
        assert all(math.isfinite(beam_score(beam, set(), penalty)) for beam in beams), penalty
    assert beam_score(beams[1], set(), 1.0) == pytest.approx(-2.0 / 5)  # in range, the formula as before
    for penalty in (float("nan"), float("inf"), "1", None):
        with pytest.raises(ValueError, match="length_penalty must be a finite number"):
            BeamSearchParams(beam_width=2, max_tokens=3, length_penalty=penalty)
