"""The decoder layer's fused kernels (RMSNorm + residual, rotary + KV-cache write, SiLU * up) vs the
model's torch reference path, on fresh random inputs with poisoned outputs; under TRITON_INTERPRET=1
on the CPU (in a fresh process: the interpreter is chosen when a kernel is defined) and on GPUs.
That they compile for sm_90 and gfx942 is checked with the other kernels in test_kernels_compile.py."""

import os

import pytest


def _close(got, ref, dtype, what):
    import torch
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one ulp of values up to ~4
    err = (got.float() - ref.float()).abs().max().item()
    assert err <= tol * max(1.0, ref.float().abs().max().item()), f"{what} ({dtype}): max error {err}"


def _rmsnorm(g, dev, dtype):
    import torch

    from tp_overlap_plugin.kernels import layer_ops
    from tp_overlap_plugin.serving.model.model import RMSNorm
    for t, n in ((1, 48), (5, 100), (3, 4096)):
        norm = RMSNorm(n, 1e-5, dtype, "cpu")
        norm.weight.data = torch.randn(n, generator=g).to(dtype)
        x = torch.randn(t, n, generator=g).to(dtype)
        res = torch.randn(t, n, generator=g).to(dtype)
        ref = norm(x)                                  # CPU: the torch reference path
        ref_out, ref_res = norm(x, res)
        w = norm.weight.to(dev)
        _close(layer_ops.rmsnorm(x.to(dev), w, 1e-5).cpu(), ref, dtype, f"rmsnorm {t}x{n}")
        out, new_res = layer_ops.rmsnorm(x.to(dev), w, 1e-5, res.to(dev))
        # the interpreter casts fp32 -> bf16 by truncation, GPUs round to nearest like torch
        if dev == "cpu":
            _close(new_res, ref_res, dtype, f"new residual {t}x{n}")
            # the norm of the residual the kernel formed: a truncated residual (one ulp off) moved the
            # output by two ulps now and then (fresh seeds), past a one-ulp bound that holds otherwise
            ref_out = norm(new_res)
        else:
            assert torch.equal(new_res.cpu(), ref_res), "the new residual is x + residual rounded once"
        _close(out.cpu(), ref_out, dtype, f"rmsnorm+residual {t}x{n}")


def _rope_and_cache(g, dev, dtype):
    import torch

    from tp_overlap_plugin.kernels import layer_ops
    from tp_overlap_plugin.serving.model.attention import write_kv
    from tp_overlap_plugin.serving.config import ModelConfig
    from tp_overlap_plugin.serving.model.model import Rotary
    for t, hq, hkv, hd in ((1, 4, 2, 16), (7, 6, 2, 32), (4, 8, 8, 64)):
        cfg = ModelConfig(arch="llama", vocab_size=16, hidden_size=hq * hd, intermediate_size=8, num_layers=1,
                          num_heads=hq, num_kv_heads=hkv, head_dim=hd, rms_norm_eps=1e-5, rope_theta=10000.0,
                          rope_scaling=None, max_position_embeddings=64, tie_word_embeddings=False,
                          qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
        rot = Rotary(cfg, 64, "cpu")
        qkv = torch.randn(t, (hq + 2 * hkv) * hd, generator=g).to(dtype)
        pos = torch.randint(0, 64, (t,), generator=g)
        blocks, page = 6, 4
        slots = torch.randperm(blocks * page, generator=g)[:t]
        poison = torch.full((blocks, page, hkv, hd), 7.0, dtype=dtype)
        # reference: the model's torch path
        q = qkv[:, :hq * hd].reshape(t, hq, hd)
        k = qkv[:, hq * hd:(hq + hkv) * hd].reshape(t, hkv, hd)
        v = qkv[:, (hq + hkv) * hd:].reshape(t, hkv, hd)
        ref_q, ref_k = rot(pos, q), rot(pos, k)
        ref_kc, ref_vc = poison.clone(), poison.clone()
        write_kv(ref_kc, ref_vc, ref_k, v, slots)
        # kernel: in place on the fused row, caches written at the slots, the rest untouched
        got = qkv.clone().to(dev)
        kc, vc = poison.clone().to(dev), poison.clone().to(dev)
        layer_ops.rope_and_cache(got, hq, hkv, hd, pos.to(dev), rot.cos.to(dev), rot.sin.to(dev), kc, vc,
                                 slots.to(dev))
        _close(got[:, :hq * hd].cpu().reshape(t, hq, hd), ref_q, dtype, f"rope q t={t} hd={hd}")
        _close(kc.cpu(), ref_kc, dtype, f"k cache t={t} hd={hd}")
        assert torch.equal(vc.cpu(), ref_vc), "v is copied into the cache unchanged"
        assert torch.equal(got[:, (hq + hkv) * hd:].cpu(), qkv[:, (hq + hkv) * hd:]), "v stays as it was"


def _silu_mul(g, dev, dtype):
    import torch

    from tp_overlap_plugin.kernels import layer_ops
    for t, n in ((1, 8), (3, 1500)):
        x = torch.randn(t, 2 * n, generator=g).to(dtype)
        gate, up = x.chunk(2, dim=-1)
        ref = torch.nn.functional.silu(gate) * up
        _close(layer_ops.silu_mul(x.to(dev)).cpu(), ref, dtype, f"silu_mul {t}x{n}")


def main(dev="cpu"):
    import torch
    g = torch.Generator().manual_seed(int.from_bytes(os.urandom(4), "little"))
    for dtype in (torch.float32, torch.bfloat16):
        _rmsnorm(g, dev, dtype)
        _rope_and_cache(g, dev, dtype)
        _silu_mul(g, dev, dtype)
    print("layer ops ok")


@pytest.mark.timeout(240)
def test_layer_ops_match_reference_under_interpreter():
    from serving_helpers import run_under_interpreter
    run_under_interpreter(__file__, "layer ops ok", timeout=230)


@pytest.mark.gpu
@pytest.mark.timeout(240)
def test_layer_ops_match_reference_on_gpu():
    import torch
    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    main("cuda")


if __name__ == "__main__":
    main()
