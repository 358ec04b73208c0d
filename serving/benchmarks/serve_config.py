"""What `tp-overlap bench serve` runs: the target, the dataset, the traffic and what is reported.
The command line (tp_overlap_plugin/cli/bench.py) fills it with `vllm bench serve`'s option names;
bench/serve_load.py and bench/serve_timeline.py build it directly."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Optional

BACKENDS = ("vllm", "openai", "openai-chat")
COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
DATASETS = ("random", "lognormal", "sharegpt", "hf")
# the request-level metrics `--percentile-metrics` may name, and those `--goodput` may bound
METRICS = ("ttft", "tpot", "itl", "e2el")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")


@dataclass(frozen=True)
class BenchServeConfig:
    # ---- target
    base_url: Optional[str] = None        # None: http://host:port
    host: str = "127.0.0.1"
    port: int = 8000
    backend: Literal["vllm", "openai", "openai-chat"] = "openai"
    endpoint: Optional[str] = None        # None: the backend's route (chat for openai-chat)
    model: Optional[str] = None           # None: the first model /v1/models lists
    tokenizer: Optional[str] = None       # counts dataset tokens; None: the server's /tokenize
    api_key: Optional[str] = None         # None: $TP_OVERLAP_API_KEY, else $OPENAI_API_KEY
    ready_check_timeout_sec: float = 0    # 0: no waiting for the server
    # ---- dataset
    dataset_name: Literal["random", "lognormal", "sharegpt", "hf"] = "random"
    dataset_path: Optional[str] = None    # sharegpt: a local JSON file; hf: a Hub dataset id
    num_prompts: int = 100
    random_input_len: int = 128
    random_output_len: int = 64
    random_range_ratio: float = 0.0
    random_prefix_len: int = 0
    random_vocab_size: int = 256
    lognormal_sigma: float = 1.0
    lognormal_max_len: int = 2048
    sharegpt_output_len: Optional[int] = None
    hf_subset: Optional[str] = None
    hf_split: str = "train"
    hf_output_len: Optional[int] = None
    seed: int = 0
    # ---- traffic
    request_rate: float = math.inf
    burstiness: float = 1.0
    max_concurrency: Optional[int] = None
    temperature: float = 0.0
    ignore_eos: bool = False
    request_timeout: float = 600.0
    # ---- results
    percentile_metrics: tuple[str, ...] = ("ttft", "tpot", "itl")
    metric_percentiles: tuple[float, ...] = (99.0,)
    goodput: dict[str, float] = field(default_factory=dict)   # metric -> its bound in ms
    save_result: bool = False
    save_detailed: bool = False
    result_dir: Optional[str] = None
    result_filename: Optional[str] = None
    result_file: Optional[str] = None     # this path, whatever --save-result would name
    label: Optional[str] = None
    disable_tqdm: bool = False

    @property
    def route(self) -> str:
        """The route every request goes to: --endpoint, else the backend's."""
        if self.endpoint is not None:
            return self.endpoint
        return CHAT if self.backend == "openai-chat" else COMPLETIONS

    @property
    def chat(self) -> bool:
        return self.route == CHAT
