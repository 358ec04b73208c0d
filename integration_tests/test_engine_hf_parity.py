"""The engine against HF transformers: same random weights, same logits, same greedy tokens; with
penalties and logit_bias, the tokens that transformers' logits processors pick.

Block size 4 and a 16-token step budget make the 40-token prompt span 10 KV blocks and 3 prefill
chunks, while the short prompts decode alongside it in the same steps.
"""

import pytest
import torch
from transformers import LogitsProcessorList, RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor

from tp_overlap_plugin.serving import LLM, EngineConfig, SamplingParams
from serving_helpers import hf_reference, make_hf_checkpoint

PROMPT_LENS = (5, 11, 40)
MAX_NEW = 6


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory):
    arch = request.param
    d = make_hf_checkpoint(arch, tmp_path_factory.mktemp(arch))
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, 250, (n,), generator=g).tolist() for n in PROMPT_LENS]
    return arch, d, prompts, hf_reference(d, prompts, MAX_NEW)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tp", [1, 2])
def test_logits_and_greedy_match_transformers(checkpoint, tp):
    arch, d, prompts, ref = checkpoint
    cfg = EngineConfig(model=str(d), tensor_parallel_size=tp, block_size=4, max_num_batched_tokens=16,
                       max_model_len=128, dtype="float32", show_progress=False, dist_timeout_s=60)
    with LLM(cfg) as llm:
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, prompt_logits=True,
                                                    logprobs=True, ignore_eos=True))
    for o, (ref_logits, ref_toks, ref_lps, _) in zip(outs, ref):
        assert o.prompt_logits.shape == ref_logits.shape
        torch.testing.assert_close(o.prompt_logits, ref_logits, atol=2e-5, rtol=1e-4)
        assert o.outputs[0].token_ids == ref_toks, f"{arch} tp={tp} prompt len {len(o.prompt_token_ids)}"
        torch.testing.assert_close(torch.tensor(o.outputs[0].logprobs), torch.tensor(ref_lps),
                                   atol=2e-5, rtol=1e-4)
        assert o.outputs[0].finish_reason == "length"


# Strong enough to change what greedy decoding picks on every architecture (asserted below).
PROCESSED = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True, logprobs=True, top_logprobs=5,
                           repetition_penalty=1.8, frequency_penalty=0.9, presence_penalty=-0.5,
                           logit_bias={3: 2.5, 17: -100.0, 200: 1.5, 249: 0.75})


def reference_processing(p: SamplingParams):
    """transformers' processors for logit_bias and repetition_penalty (over prompt and output), then
    OpenAI's frequency and presence penalties (over the output) in float64: transformers has none."""
    hf = LogitsProcessorList([SequenceBiasLogitsProcessor({(t,): b for t, b in p.logit_bias.items()}),
                              RepetitionPenaltyLogitsProcessor(p.repetition_penalty)])

    def process(ids, logits, n_prompt):
        x = hf(ids, logits).double()
        counts = torch.bincount(ids[0, n_prompt:], minlength=x.shape[-1]).double()
        return x - p.frequency_penalty * counts - p.presence_penalty * (counts > 0).double()

    return process


@pytest.mark.timeout(120)
def test_penalties_bias_and_top_logprobs_match_transformers(checkpoint):
    arch, d, prompts, plain = checkpoint
    ref = hf_reference(d, prompts, MAX_NEW, process=reference_processing(PROCESSED))
    cfg = EngineConfig(model=str(d), block_size=4, max_num_batched_tokens=16, max_model_len=128,
                       dtype="float32", show_progress=False)
    with LLM(cfg) as llm:
        outs = llm.generate(prompts, PROCESSED)
    for o, (_, toks, lps, logp) in zip(outs, ref):
        c = o.outputs[0]
        assert c.token_ids == toks, f"{arch} prompt len {len(o.prompt_token_ids)}"
        # log-probabilities of the raw distribution, not of the processed one
        torch.testing.assert_close(torch.tensor(c.logprobs), torch.tensor(lps), atol=2e-5, rtol=1e-4)
        top_lp, top_ids = logp.topk(PROCESSED.top_logprobs, dim=-1)
        assert [[t for t, _ in row] for row in c.top_logprobs] == top_ids.tolist()
        torch.testing.assert_close(torch.tensor([[v for _, v in row] for row in c.top_logprobs]), top_lp,
                                   atol=2e-5, rtol=1e-4)
    assert any(o.outputs[0].token_ids != r[1] for o, r in zip(outs, plain)), "the processing changed nothing"


@pytest.mark.gpu
@pytest.mark.timeout(300)
def test_gpu_triton_and_cuda_graphs_match_transformers(checkpoint):
    """On CUDA: Triton attention for prefill, CUDA-graph replay for decode; float32 against HF on CPU."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    arch, d, prompts, ref = checkpoint
    cfg = EngineConfig(model=str(d), block_size=4, max_num_batched_tokens=16, max_model_len=128,
                       dtype="float32", max_num_seqs=8, num_kv_blocks=256, show_progress=False)
    with LLM(cfg) as llm:
        assert llm.engine.runner.graphs, "decode CUDA graphs were not captured"
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=MAX_NEW, prompt_logits=True,
                                                    logprobs=True, ignore_eos=True))
    for o, (ref_logits, ref_toks, ref_lps, _) in zip(outs, ref):
        torch.testing.assert_close(o.prompt_logits, ref_logits, atol=2e-4, rtol=1e-3)
        assert o.outputs[0].token_ids == ref_toks
        torch.testing.assert_close(torch.tensor(o.outputs[0].logprobs), torch.tensor(ref_lps), atol=2e-4, rtol=1e-3)
