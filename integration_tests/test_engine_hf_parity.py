"""The engine against HF transformers: same random weights, same logits, same greedy tokens.

Block size 4 and a 16-token step budget make the 40-token prompt span 10 KV blocks and 3 prefill
chunks, while the short prompts decode alongside it in the same steps.
"""

import pytest
import torch

from tp_overlap_plugin.serving import LLM, EngineConfig, SamplingParams
from tp_overlap_plugin.serving.testing import hf_reference, make_hf_checkpoint

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
    for o, (ref_logits, ref_toks, ref_lps) in zip(outs, ref):
        assert o.prompt_logits.shape == ref_logits.shape
        torch.testing.assert_close(o.prompt_logits, ref_logits, atol=2e-5, rtol=1e-4)
        assert o.outputs[0].token_ids == ref_toks, f"{arch} tp={tp} prompt len {len(o.prompt_token_ids)}"
        torch.testing.assert_close(torch.tensor(o.outputs[0].logprobs), torch.tensor(ref_lps),
                                   atol=2e-5, rtol=1e-4)
        assert o.outputs[0].finish_reason == "length"


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
    for o, (ref_logits, ref_toks, ref_lps) in zip(outs, ref):
        torch.testing.assert_close(o.prompt_logits, ref_logits, atol=2e-4, rtol=1e-3)
        assert o.outputs[0].token_ids == ref_toks
        torch.testing.assert_close(torch.tensor(o.outputs[0].logprobs), torch.tensor(ref_lps), atol=2e-4, rtol=1e-3)
