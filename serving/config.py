"""Engine, model and sampling configuration."""

from __future__ import annotations

import functools
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tp_overlap_plugin import options
from tp_overlap_plugin.options import TPOverlapOptions, options_from_env

SHIPPED_CONFIGS = Path(__file__).parent / "model" / "model_configs"
DEMO_MODEL = "demo"

SUPPORTED_ARCHS = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
}


@dataclass
class ModelConfig:
    """The architecture facts the engine needs, read from an HF config.json."""

    arch: str  # "llama" | "qwen2" | "qwen3"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: Optional[int] = None
    torch_dtype: Optional[str] = None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> "ModelConfig":
        archs = cfg.get("architectures") or []
        arch = next((SUPPORTED_ARCHS[a] for a in archs if a in SUPPORTED_ARCHS), None)
        if arch is None:
            mt = cfg.get("model_type")
            arch = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}.get(mt)
        if arch is None:
            raise ValueError(f"unsupported architecture {archs or cfg.get('model_type')}; "
                             f"supported: {sorted(SUPPORTED_ARCHS)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}; only silu")
        if cfg.get("use_sliding_window") or (arch == "llama" and cfg.get("sliding_window")):
            raise ValueError("sliding-window attention is not supported")
        heads = cfg["num_attention_heads"]
        hidden = cfg["hidden_size"]
        # Transformers 5 nests rope settings in rope_parameters; older configs use rope_theta + rope_scaling.
        rope = dict(cfg.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or cfg.get("rope_theta", 10000.0)
        scaling = rope or cfg.get("rope_scaling")
        if scaling:
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind == "default":
                scaling = None
            elif kind not in ("llama3", "linear"):
                raise ValueError(f"unsupported rope scaling {kind!r}; supported: default, linear, llama3")
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            arch=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=hidden,
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=heads,
            num_kv_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or hidden // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(theta),
            rope_scaling=scaling or None,
            max_position_embeddings=cfg.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=bool(cfg.get("attention_bias", False)) or arch == "qwen2",
            o_bias=bool(cfg.get("attention_bias", False)) and arch in ("llama", "qwen3"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=arch == "qwen3",
            eos_token_ids=eos_ids,
            bos_token_id=cfg.get("bos_token_id"),
            torch_dtype=cfg.get("torch_dtype") or cfg.get("dtype"),
        )

    def check_tp(self, world_size: int) -> None:
        for name, n in (("num_attention_heads", self.num_heads), ("num_key_value_heads", self.num_kv_heads),
                        ("intermediate_size", self.intermediate_size)):
            if n % world_size != 0:
                raise ValueError(f"tensor_parallel_size={world_size} does not divide {name}={n}; "
                                 f"choose a size that divides the head counts")


# An `org/name` id on the Hugging Face Hub (a path that does not exist locally and has this shape).
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
# What the engine reads from a Hub repository: config, tokenizer and chat-template files, and the
# weights only when they will be loaded (not for --load-format dummy, nor for the config alone).
_HUB_FILES = ["*.json", "tokenizer.model", "*.jinja"]
_HUB_WEIGHTS = ["*.safetensors"]


def resolve_model_dir(model: str, weights: bool = True) -> Optional[Path]:
    """A model is 'demo', a directory with config.json, the name of a config shipped in model_configs/, or
    a Hugging Face Hub id (`org/name`), fetched into the Hub cache (HF_HOME and HF_HUB_OFFLINE apply).
    `weights=False`: the caller reads only the config and tokenizer, so a Hub model's weights are not fetched."""
    if model == DEMO_MODEL:
        return None
    p = Path(model).expanduser()
    if (p / "config.json").is_file():
        return p
    shipped = SHIPPED_CONFIGS / model
    if (shipped / "config.json").is_file():
        return shipped
    if _HUB_ID.match(model) and not p.exists():
        return hub_snapshot(model, weights)
    names = sorted(d.name for d in SHIPPED_CONFIGS.iterdir() if (d / "config.json").is_file())
    raise FileNotFoundError(f"model {model!r}: no config.json there; use 'demo', a local model directory, "
                            f"a Hugging Face Hub id (org/name), or a shipped config name ({', '.join(names)})")


@functools.lru_cache(maxsize=None)
def hub_snapshot(repo_id: str, weights: bool = True) -> Path:
    """The local snapshot directory of a Hub model, downloaded into the Hub cache when missing (once per
    process: every engine part that resolves the model asks again)."""
    try:
        import huggingface_hub as hub
        from huggingface_hub import constants, errors
    except ImportError as e:
        raise FileNotFoundError(f"model {repo_id!r} looks like a Hugging Face Hub id, which needs huggingface_hub "
                                f"(pip install 'tp-overlap[serve]'): {e}") from None
    patterns = _HUB_FILES + (_HUB_WEIGHTS if weights else [])
    cache = constants.HF_HUB_CACHE
    try:
        path = Path(hub.snapshot_download(repo_id, allow_patterns=patterns))
    except errors.GatedRepoError:
        raise FileNotFoundError(f"model {repo_id!r} is gated on the Hugging Face Hub: accept its terms on the "
                                f"model page, then log in (`hf auth login`) or set HF_TOKEN") from None
    except errors.RepositoryNotFoundError:
        raise FileNotFoundError(f"model {repo_id!r}: no such model on the Hugging Face Hub, or it is private "
                                f"(log in with `hf auth login` or set HF_TOKEN), and no local directory of "
                                f"that name") from None
    except errors.LocalEntryNotFoundError as e:
        if constants.HF_HUB_OFFLINE:
            raise FileNotFoundError(f"model {repo_id!r} is no local directory and not in the Hugging Face cache "
                                    f"({cache}), and HF_HUB_OFFLINE is set; download it first "
                                    f"(`hf download {repo_id}`) or unset HF_HUB_OFFLINE") from None
        raise FileNotFoundError(f"model {repo_id!r} is no local directory, could not be fetched from the Hugging "
                                f"Face Hub, and is not in its cache ({cache}): {' '.join(str(e).split())}") from None
    except errors.HfHubHTTPError as e:
        raise FileNotFoundError(f"model {repo_id!r}: the Hugging Face Hub answered "
                                f"{' '.join(str(e).split())}") from None
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"model {repo_id!r}: its Hub snapshot {path} has no config.json")
    return path


class EngineConfig(BaseModel):
    """Everything that shapes an engine instance. Validated on construction."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=())

    model: str = Field(DEMO_MODEL, description="'demo', a local HF model directory, a Hugging Face Hub id "
                                               "(org/name), or a shipped config name")
    tokenizer: Optional[str] = Field(None, description="tokenizer directory; default: the model directory")
    tensor_parallel_size: int = Field(1, ge=1)
    load_format: Literal["auto", "safetensors", "dummy"] = "auto"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    max_model_len: Optional[int] = Field(None, ge=2)
    max_num_seqs: int = Field(64, ge=1)
    max_num_batched_tokens: int = Field(2048, ge=1, description="token budget of one step; longer prompts are chunked")
    block_size: int = Field(16, ge=1, le=1024)
    gpu_memory_utilization: float = Field(0.9, gt=0.0, le=1.0)
    kv_cache_bytes: int = Field(256 << 20, ge=1, description="KV cache budget per rank on CPU")
    num_kv_blocks: Optional[int] = Field(None, ge=1, description="override the computed number of KV blocks")
    seed: int = 0
    enforce_eager: bool = False
    # on by default: at TP=1 and TP=2 on H200 it takes decode steps from 1.27-4.28x to 1.20-2.34x the
    # memory floor (bench/results/decode-profile-*-2026-11-23), and greedy output is the same
    async_scheduling: bool = Field(True, description="build and launch step i+1 before step i's tokens reach "
                                   "the host; sampled ids feed the next step on the device")
    enable_prefix_caching: bool = True
    cuda_graph_batch_sizes: Optional[list[int]] = None
    # Prefill and mixed steps replay every part but attention from graphs per token-count bucket
    # (serving/worker/piecewise.py); off: those steps run eagerly. enforce_eager turns these off too.
    piecewise_cuda_graphs: bool = True
    piecewise_graph_token_counts: Optional[list[int]] = Field(
        None, description="buckets of the piecewise graphs; default: piecewise.default_token_counts")
    dist_timeout_s: float = Field(600.0, gt=0)
    show_progress: bool = True
    # The plugin's options (tp_overlap_plugin/options.py), validated by pydantic through the dataclass.
    tp_overlap: Optional[TPOverlapOptions] = Field(default_factory=options_from_env,
                                                   description="overlapped TP kernels; true, false or a sub-config")

    @model_validator(mode="before")
    @classmethod
    def _flag_shorthand(cls, data):
        # true / false mean what they mean in vLLM's section and TP_OVERLAP: TPOverlapOptions.from_section
        if isinstance(data, dict) and isinstance(data.get("tp_overlap"), bool):
            data = {**data, "tp_overlap": TPOverlapOptions.from_section(data["tp_overlap"], "tp_overlap")}
        return data

    @property
    def overlap_enabled(self) -> bool:
        return self.tp_overlap is not None and self.tp_overlap.enabled

    @model_validator(mode="after")
    def _check(self) -> "EngineConfig":
        if self.cuda_graph_batch_sizes is not None and any(b < 1 for b in self.cuda_graph_batch_sizes):
            raise ValueError("cuda_graph_batch_sizes must be positive")
        if self.piecewise_graph_token_counts is not None:
            from .worker.piecewise import check_token_counts
            check_token_counts(self.piecewise_graph_token_counts, self.max_num_batched_tokens)
        return self

    def load_model_config(self) -> ModelConfig:
        d = resolve_model_dir(self.model, weights=False)
        if d is None:
            from .model.demo import demo_hf_config
            return ModelConfig.from_hf(demo_hf_config())
        with open(d / "config.json") as f:
            return ModelConfig.from_hf(json.load(f))

    def effective_load_format(self) -> str:
        d = resolve_model_dir(self.model, weights=self.load_format != "dummy")
        if d is None:
            return "demo"
        if self.load_format != "auto":
            return self.load_format
        if any(d.glob("*.safetensors")):
            return "safetensors"
        raise MissingWeights(d)


class MissingWeights(FileNotFoundError):
    """A model directory without weights (a shipped config has none); `directory` is where they were sought."""

    def __init__(self, directory: Path):
        super().__init__(f"no *.safetensors in {directory}; pass load_format='dummy' for random weights")
        self.directory = directory


# vLLM's default cap (--max-logprobs) and OpenAI's chat limit: a top-k this wide is one small topk per step.
MAX_TOP_LOGPROBS = 20
# OpenAI's range for a logit bias.
MAX_LOGIT_BIAS = 100.0

# The sampling knobs' bounds, written once: SamplingParams and the HTTP requests (protocol.py) take
# these types, so a request is refused at the door with the same limits the engine holds.
Temperature = Annotated[float, Field(ge=0.0)]    # (the HTTP API adds OpenAI's upper bound, 2)
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]               # presence and frequency (OpenAI's range)
RepetitionPenalty = Annotated[float, Field(gt=0.0, le=10.0)]     # vLLM's; 1 disables
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]


class RequestError(ValueError):
    """A request the engine refuses; `param` names the SamplingParams field at fault (the server's
    400 names it too)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


class ContextLengthError(RequestError):
    """A prompt and its max_tokens that do not fit the model's context (InputProcessor.check_context);
    `param` names what to shorten or lower."""


class StructuredOutput(BaseModel):
    """A grammar the output must follow (serving/engine/structured.py compiles it), exactly one of: any JSON
    object, JSON that validates against a schema, text that fully matches a regular expression, one of a
    list of strings, or an EBNF grammar (xgrammar's dialect, root rule `root`)."""

    model_config = ConfigDict(extra="forbid")

    json_object: bool = False
    json_schema: Optional[dict[str, Any]] = None
    regex: Optional[str] = None
    choice: Optional[list[str]] = Field(None, min_length=1)
    grammar: Optional[str] = None

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutput":
        kinds = [k for k in ("json_schema", "regex", "choice", "grammar") if getattr(self, k) is not None]
        if self.json_object:
            kinds.append("json_object")
        if len(kinds) != 1:
            raise ValueError("a structured output is exactly one of json_object=True, json_schema, regex, choice "
                             f"and grammar; got {', '.join(kinds) or 'none'}")
        return self


class SamplingParams(BaseModel):
    """Per-request sampling. temperature 0 means greedy.

    The logits are processed in this order before sampling (vLLM's): the structured-output mask,
    logit_bias, repetition_penalty, then frequency and presence penalties; then temperature, top-k,
    top-p, min-p. Reported log-probabilities are of the raw model distribution, before any of it."""

    model_config = ConfigDict(extra="forbid")

    max_tokens: int = Field(16, ge=1)
    temperature: Temperature = 1.0
    top_k: int = Field(0, ge=0, description="0 disables")
    top_p: TopP = 1.0
    min_p: MinP = 0.0
    seed: Optional[int] = None
    stop: list[str] = Field(default_factory=list)
    stop_token_ids: list[int] = Field(default_factory=list)
    ignore_eos: bool = False
    logprobs: bool = Field(False, description="return the log-probability of each chosen token")
    top_logprobs: TopLogprobs = Field(0, description="also the most likely tokens at each position (needs logprobs)")
    presence_penalty: Penalty = Field(0.0, description="subtracted from the logit of every token generated so far "
                                      "(OpenAI)")
    frequency_penalty: Penalty = Field(0.0, description="subtracted once per time a token was generated so far "
                                       "(OpenAI)")
    repetition_penalty: RepetitionPenalty = Field(1.0, description="divides positive and multiplies negative logits "
                                                  "of tokens in the prompt or the output (HF/vLLM); 1 disables")
    logit_bias: Optional[dict[int, float]] = Field(None, description="token id -> bias added to its logit, "
                                                   f"in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
    structured_output: Optional[StructuredOutput] = None
    prompt_logits: bool = Field(False, description="return the raw logits at every prompt position")
    include_stop_str_in_output: bool = False
    min_tokens: int = Field(0, ge=0, description="the end-of-sequence and stop_token_ids cannot be sampled, and "
                            "stop strings are not matched, until this many tokens were generated (vLLM's)")
    skip_special_tokens: bool = Field(True, description="leave special tokens out of the text")
    # (apiext) vLLM's: the front end tokenizes bad_words (input_processor.py); the core bans each word's last
    # token after its other tokens.
    bad_words: list[str] = Field(default_factory=list, description="words whose tokens are never generated in "
                                 "sequence (vLLM's bad_words)")
    allowed_token_ids: Optional[list[int]] = Field(None, min_length=1, description="only these tokens can be "
                                                   "generated")
    cache_salt: Optional[str] = Field(None, min_length=1, description="prefix-cache blocks are shared only among "
                                      "requests with the same salt")

    @model_validator(mode="before")
    @classmethod
    def _stop_as_list(cls, data):
        if isinstance(data, dict) and isinstance(data.get("stop"), str):
            data = {**data, "stop": [data["stop"]]}
        return data

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if any(s == "" for s in self.stop):
            raise ValueError("stop strings must be non-empty")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative")
        if not math.isfinite(self.temperature):
            raise ValueError("temperature must be finite")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=True")
        for t, b in (self.logit_bias or {}).items():
            if t < 0:
                raise ValueError(f"logit_bias token id {t} is negative")
            if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS:   # (also rejects NaN)
                raise ValueError(f"logit_bias of token {t} is {b}; it must be in "
                                 f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
        if self.structured_output is not None and self.ignore_eos:
            raise ValueError("ignore_eos cannot be combined with a structured output: the grammar ends the "
                             "output with the end-of-sequence token once the JSON is complete")
        if any(t < 0 for t in self.allowed_token_ids or ()):
            raise ValueError("allowed_token_ids must be non-negative")
        if any(w == "" for w in self.bad_words):
            raise ValueError("bad_words must be non-empty strings")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens={self.min_tokens} is more than max_tokens={self.max_tokens}")
        if self.structured_output is not None and self.min_tokens:
            raise ValueError("min_tokens cannot be combined with a structured output: the grammar ends the "
                             "output with the end-of-sequence token once it is complete")
        return self

    @property
    def penalized(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)

    @property
    def needs_token_state(self) -> bool:
        """Whether sampling reads per-sequence state kept on the device (sampler.TokenState)."""
        return self.penalized or bool(self.logit_bias) or self.allowed_token_ids is not None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def default_device(cfg: EngineConfig) -> str:
    import torch
    if cfg.device != "auto":
        return cfg.device
    return "cuda" if torch.cuda.is_available() else "cpu"


def env_rank_world() -> Optional[tuple[int, int, int]]:
    """(rank, world_size, local_rank) when launched by torchrun, else None."""
    return options.env_launcher_rank()
