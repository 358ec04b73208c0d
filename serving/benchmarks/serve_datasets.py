"""The requests `bench serve` sends, by `--dataset-name`, as `vllm bench serve` draws them:

- `random`: /v1/completions prompts are token ids drawn uniformly from [0, --random-vocab-size), so the
  input length is exact for any tokenizer; chat prompts are random lower-case words of about
  --random-input-len characters (the server's count is what is reported). Lengths are drawn uniformly
  from [len * (1 - ratio), len * (1 + ratio)]. --random-prefix-len puts one shared prefix (token ids, or
  characters for chat) before every prompt, as a prefix cache would see a system prompt.
- `lognormal`: the same prompts, with lengths drawn from lognormal distributions whose medians are
  --random-input-len / --random-output-len (workloads.py): a ShareGPT-like long tail, made in code.
- `sharegpt`: a local ShareGPT JSON file (--dataset-path): each entry's first turn is the prompt, the
  second's token count the output length (or --sharegpt-output-len).
- `hf`: a Hugging Face Hub dataset (--dataset-path its id, --hf-subset, --hf-split), streamed with the
  `datasets` package: ShareGPT-style `conversations`, chat `messages`, or a prompt column
  (prompt / question / instruction / ...) with an optional answer column for the output length.

ShareGPT and Hub rows are kept as vLLM keeps them: prompt and output at least 4 tokens, the prompt at
most 1024 and both at most 2048; the entries are shuffled with --seed, and a file with fewer usable
entries than --num-prompts is sampled again from the start (said on stderr).
"""

from __future__ import annotations

import json
import random
import sys
from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Union

from ..user_errors import CliError
from .serve_config import BenchServeConfig
from .workloads import MIN_LEN, lognormal_lengths

MAX_PROMPT_LEN, MAX_TOTAL_LEN = 1024, 2048
PROMPT_COLUMNS = ("prompt", "question", "instruction", "input", "query", "problem", "text")
ANSWER_COLUMNS = ("completion", "response", "answer", "output", "solution", "chosen")
_LETTERS = "abcdefghijklmnopqrstuvwxyz"


@dataclass(frozen=True)
class SampleRequest:
    prompt: Union[str, list[int]]   # text, or token ids (completions only)
    output_len: int                 # the request's max_tokens


def _lengths(rng: random.Random, n: int, mean: int, ratio: float) -> list[int]:
    lo, hi = max(1, int(mean * (1 - ratio))), max(1, int(mean * (1 + ratio)))
    return [rng.randint(lo, hi) for _ in range(n)]


def _words(rng: random.Random, n_chars: int) -> str:
    words, size = [], 0
    while size < n_chars:
        w = "".join(rng.choice(_LETTERS) for _ in range(rng.randint(2, 8)))
        words.append(w)
        size += len(w) + 1
    return " ".join(words)[:n_chars]


def random_requests(cfg: BenchServeConfig) -> list[SampleRequest]:
    rng = random.Random(cfg.seed)
    if cfg.dataset_name == "lognormal":
        pairs = lognormal_lengths(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                                  cfg.lognormal_sigma, cfg.lognormal_max_len, cfg.seed)
        ins, outs = [i for i, _ in pairs], [o for _, o in pairs]
    else:
        ins = _lengths(rng, cfg.num_prompts, cfg.random_input_len, cfg.random_range_ratio)
        outs = _lengths(rng, cfg.num_prompts, cfg.random_output_len, cfg.random_range_ratio)
    n_prefix = cfg.random_prefix_len
    if cfg.chat:
        prefix = _words(rng, n_prefix) + " " if n_prefix else ""
        return [SampleRequest(prefix + _words(rng, n_in), n_out) for n_in, n_out in zip(ins, outs)]
    ids = [rng.randrange(cfg.random_vocab_size) for _ in range(n_prefix)]
    return [SampleRequest(ids + [rng.randrange(cfg.random_vocab_size) for _ in range(n_in)], n_out)
            for n_in, n_out in zip(ins, outs)]


def _take(pairs: Iterable[tuple[str, Optional[str]]], cfg: BenchServeConfig, count: Callable[[str], int],
          fixed_output: Optional[int], source: str) -> list[SampleRequest]:
    """--num-prompts requests of (prompt, answer) pairs that pass vLLM's length filter."""
    kept: list[SampleRequest] = []
    for prompt, answer in pairs:
        n_in = count(prompt)
        n_out = fixed_output if fixed_output is not None else (count(answer) if answer else 0)
        if n_in < MIN_LEN or n_in > MAX_PROMPT_LEN or n_in + n_out > MAX_TOTAL_LEN:
            continue
        if fixed_output is None and n_out < MIN_LEN:
            continue
        kept.append(SampleRequest(prompt, n_out))
        if len(kept) == cfg.num_prompts:
            return kept
    if not kept:
        raise CliError(f"{source} has no entry with a prompt of {MIN_LEN}-{MAX_PROMPT_LEN} tokens and an answer of "
                       f"at least {MIN_LEN} (both at most {MAX_TOTAL_LEN})", status=1,
                       hint=None if fixed_output is not None else
                       "entries without an answer need the output length: --sharegpt-output-len / --hf-output-len")
    print(f"bench serve: {source} has {len(kept)} usable entries for --num-prompts {cfg.num_prompts}: "
          f"the rest are drawn again from them", file=sys.stderr)
    rng = random.Random(cfg.seed)
    return kept + rng.choices(kept, k=cfg.num_prompts - len(kept))


def _turns(turns) -> tuple[Optional[str], Optional[str]]:
    """The first turn's text and the second's, of a ShareGPT (`from`/`value`) or chat (`role`/`content`) list."""
    if not isinstance(turns, list) or not turns or not all(isinstance(t, dict) for t in turns):
        return None, None
    texts = [t.get("value", t.get("content")) for t in turns[:2]]
    texts = [t if isinstance(t, str) else None for t in texts] + [None]
    return texts[0], texts[1]


def sharegpt_requests(cfg: BenchServeConfig, count: Callable[[str], int]) -> list[SampleRequest]:
    if not cfg.dataset_path:
        raise CliError("--dataset-name sharegpt reads a local file: give it with --dataset-path",
                       hint='ShareGPT\'s JSON: a list of {"conversations": [{"from": "human", "value": ...}, '
                            '{"from": "gpt", "value": ...}]}')
    try:
        with open(cfg.dataset_path, encoding="utf-8") as f:
            data = json.load(f)
    except OSError as e:
        raise CliError(f"--dataset-path {cfg.dataset_path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise CliError(f"--dataset-path {cfg.dataset_path} is not JSON ({e})") from None
    if not isinstance(data, list):
        raise CliError(f"--dataset-path {cfg.dataset_path}: ShareGPT's JSON is a list of entries, "
                       f"this file holds a {type(data).__name__}")
    pairs = [_turns(e.get("conversations", e.get("conversation"))) for e in data if isinstance(e, dict)]
    pairs = [(p, a) for p, a in pairs if p and a]     # a conversation of two turns at least, as vLLM reads it
    random.Random(cfg.seed).shuffle(pairs)
    return _take(pairs, cfg, count, cfg.sharegpt_output_len, f"--dataset-path {cfg.dataset_path}")


def _row_pair(row: dict) -> tuple[Optional[str], Optional[str]]:
    for key in ("conversations", "conversation", "messages"):
        if key in row:
            return _turns(row[key])
    prompt = next((row[c] for c in PROMPT_COLUMNS if isinstance(row.get(c), str)), None)
    answer = next((row[c] for c in ANSWER_COLUMNS if isinstance(row.get(c), str)), None)
    return prompt, answer


def hf_requests(cfg: BenchServeConfig, count: Callable[[str], int]) -> list[SampleRequest]:
    name = f"the Hugging Face dataset {cfg.dataset_path}"
    if not cfg.dataset_path:
        raise CliError("--dataset-name hf needs --dataset-path, the dataset's Hub id (org/name)")
    try:
        import datasets
    except ImportError:
        raise CliError("--dataset-name hf reads the Hub with the `datasets` package, which is not installed",
                       hint="pip install datasets (or the checkout's '.[bench]' extra)") from None
    hint = ("the Hub must be reachable from here (a network, HF_HUB_OFFLINE unset); with a local ShareGPT-style "
            "copy, use --dataset-name sharegpt --dataset-path FILE")
    columns: list[str] = []

    def rows():
        # streamed: a few hundred rows are read, not the whole dataset
        ds = datasets.load_dataset(cfg.dataset_path, name=cfg.hf_subset, split=cfg.hf_split, streaming=True)
        for row in ds.shuffle(seed=cfg.seed, buffer_size=1000):
            columns[:] = list(row)
            prompt, answer = _row_pair(row)
            if prompt is None:
                raise CliError(f"{name} has no prompt column: it has {', '.join(columns)}; bench serve reads "
                               f"conversations, messages or one of {', '.join(PROMPT_COLUMNS)}")
            yield prompt, answer

    try:
        return _take(rows(), cfg, count, cfg.hf_output_len, name)
    except CliError:
        raise
    except Exception as e:   # the Hub unreachable, no such dataset or split: the library's own words
        raise CliError(f"cannot load {name} (subset {cfg.hf_subset}, split {cfg.hf_split}): "
                       f"{type(e).__name__}: {e}", hint=hint, status=1) from None


def sample_requests(cfg: BenchServeConfig, count: Optional[Callable[[str], int]] = None) -> list[SampleRequest]:
    """The requests of cfg's dataset; `count` (text -> tokens) reads the lengths of sharegpt and hf entries."""
    if cfg.dataset_name in ("random", "lognormal"):
        return random_requests(cfg)
    assert count is not None, "sharegpt and hf need a token counter"
    return (sharegpt_requests if cfg.dataset_name == "sharegpt" else hf_requests)(cfg, count)
