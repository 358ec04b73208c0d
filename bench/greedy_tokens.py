"""Greedy (temperature 0) output ids of a fixed batch, as JSON: run it under two installs of the
engine and compare the files to show that a change left outputs alone (issue 29's A/B).

    python bench/greedy_tokens.py OUT.json [--model llama-3-8b --prompts 24 --max-tokens 48] [--top2]
    python bench/greedy_tokens.py --compare OLD.json NEW.json

With --top2 the file also holds each position's two best log-probabilities; --compare then reports,
for every sequence that changed, the first position where it diverges and OLD's top-2 gap there
(the logit gap: log-softmax differences are logit differences), to tell a near-tie from a bug.

Prompts of 5-600 random ids (seeded), dummy weights (seeded), chunked prefill and mixed steps
included (a step budget below the batch's prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import random


def _load(path):
    with open(path) as f:
        data = json.load(f)
    return (data["ids"], data["top2"]) if isinstance(data, dict) else (data, None)


def compare(old_path, new_path):
    """Prints and returns {identical, total, diverged: [{seq, pos, old, new, old_top2_gap}]}."""
    (old, old_top), (new, _) = _load(old_path), _load(new_path)
    if len(old) != len(new):
        raise SystemExit(f"{old_path} has {len(old)} sequences, {new_path} {len(new)}")
    diverged = []
    for i, (a, b) in enumerate(zip(old, new)):
        if a == b:
            continue
        pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        gap = None
        if old_top is not None and pos < len(old_top[i]) and len(old_top[i][pos]) >= 2:
            gap = old_top[i][pos][0][1] - old_top[i][pos][1][1]
        diverged.append({"seq": i, "pos": pos, "old": a[pos] if pos < len(a) else None,
                         "new": b[pos] if pos < len(b) else None, "old_top2_gap": gap})
    res = {"identical": len(old) - len(diverged), "total": len(old), "diverged": diverged}
    print(f"{res['identical']}/{res['total']} identical")
    for d in diverged:
        gap = "n/a" if d["old_top2_gap"] is None else f"{d['old_top2_gap']:.4g}"
        print(f"  seq {d['seq']}: first divergence at token {d['pos']} ({d['old']} -> {d['new']}), "
              f"old top-2 logit gap {gap}")
    return res


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", nargs="?")
    p.add_argument("--compare", nargs=2, metavar=("OLD", "NEW"))
    p.add_argument("--top2", action="store_true", help="also record each position's two best log-probabilities")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="auto", help="the model's (auto), float32, bfloat16")
    args = p.parse_args(argv)
    if args.compare:
        return compare(*args.compare)
    if not args.out:
        p.error("OUT.json is needed unless --compare")
    from tp_overlap_plugin.serving import LLM, SamplingParams
    rng = random.Random(0)
    with LLM(model=args.model, load_format="dummy" if args.model != "demo" else "auto", max_model_len=1024,
             max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
             show_progress=False) as llm:
        vocab = llm.engine.mcfg.vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(5, 600))] for _ in range(args.prompts)]
        extra = dict(logprobs=True, top_logprobs=2) if args.top2 else {}
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True,
                                                    **extra))
    ids = [o.outputs[0].token_ids for o in outs]
    with open(args.out, "w") as f:
        json.dump({"ids": ids, "top2": [o.outputs[0].top_logprobs for o in outs]} if args.top2 else ids, f)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
