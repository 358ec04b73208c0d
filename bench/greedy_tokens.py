"""Greedy (temperature 0) output ids of a fixed batch, as JSON: run it under two installs of the
engine and compare the files to show that a change left outputs alone (issue 29's A/B).

    python bench/greedy_tokens.py OUT.json [--model llama-3-8b --prompts 24 --max-tokens 48]

Prompts of 5-600 random ids (seeded), dummy weights (seeded), chunked prefill and mixed steps
included (a step budget below the batch's prompt tokens).
"""

from __future__ import annotations

import argparse
import json
import random


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out")
    p.add_argument("--model", default="llama-3-8b")
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--max-num-batched-tokens", type=int, default=1024)
    p.add_argument("--dtype", default="auto", help="the model's (auto), float32, bfloat16")
    args = p.parse_args(argv)
    from tp_overlap_plugin.serving import LLM, SamplingParams
    rng = random.Random(0)
    with LLM(model=args.model, load_format="dummy" if args.model != "demo" else "auto", max_model_len=1024,
             max_num_seqs=16, max_num_batched_tokens=args.max_num_batched_tokens, dtype=args.dtype,
             show_progress=False) as llm:
        vocab = llm.engine.mcfg.vocab_size
        prompts = [[rng.randrange(10, vocab) for _ in range(rng.randint(5, 600))] for _ in range(args.prompts)]
        outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True))
    with open(args.out, "w") as f:
        json.dump([o.outputs[0].token_ids for o in outs], f)
    print("wrote", args.out)


if __name__ == "__main__":
    main()
