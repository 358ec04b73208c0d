"""The engine core imports only the core: no tokenizer, no input processing, no front end, no HTTP.

serving/engine/core_process.py runs in a process of its own and takes token ids; what it imports, and
what those modules import in turn (module level and inside functions, not under TYPE_CHECKING), is
read from the source with `ast`. A tokenizer module, the front end's modules or an HTTP module among
them fails the test, as does a third-party tokenizer or web library.
"""

from __future__ import annotations

from test_code_layout import _imports, _modules

PACKAGE = "tp_overlap_plugin"
CORE = "tp_overlap_plugin.serving.engine.core_process"
# Modules of the front end and the server, by their last name (wherever the serving/ folders put them).
FRONT_END = {"tokenizer", "input_processor", "front_end", "request_stream", "outputs", "llm_engine", "llm",
             "async_llm", "core_client", "api_server", "protocol", "metrics", "cli"}
FRONT_END_PREFIXES = ("serving_", "server_")
THIRD_PARTY = {"transformers", "tokenizers", "fastapi", "starlette", "uvicorn", "httpx", "openai", "jinja2"}


def _closure(start: str) -> tuple[dict[str, str], dict[str, str]]:
    """Every package module `start` reaches, and every third-party name, each with who imports it."""
    mods = _modules()
    seen, third, todo = {start: start}, {}, [start]
    while todo:
        name = todo.pop()
        theirs: set[str] = set()
        ours = _imports(name, mods[name], mods, type_checking=False, third_party=theirs)
        for m in ours - seen.keys():
            seen[m] = name
            todo.append(m)
        for t in theirs:
            third.setdefault(t, name)
    return seen, third


def _front_end_imports(start: str) -> list[str]:
    seen, third = _closure(start)
    bad = [f"{m} (imported by {by})" for m, by in sorted(seen.items())
           if m.startswith(f"{PACKAGE}.serving") and (m.rsplit(".", 1)[-1] in FRONT_END
                                                      or m.rsplit(".", 1)[-1].startswith(FRONT_END_PREFIXES))]
    bad += [f"{t} (imported by {by})" for t, by in sorted(third.items()) if t in THIRD_PARTY]
    return bad


def test_the_core_process_imports_only_the_core():
    seen, _ = _closure(CORE)
    # the walker follows the core down to the ranks and the model: a walk that stopped early passes anything
    assert {"tp_overlap_plugin.serving.engine.core", "tp_overlap_plugin.serving.engine.messages"} <= seen.keys()
    assert any(m.endswith(".runner") for m in seen) and any(m.endswith(".scheduler") for m in seen)
    bad = _front_end_imports(CORE)
    assert not bad, f"the engine core reaches front-end, tokenizer or HTTP modules: {bad}"


def test_the_check_sees_the_front_end():
    """The same walk from AsyncLLM finds the tokenizer and the front end: the check can fail."""
    bad = " ".join(_front_end_imports("tp_overlap_plugin.serving.engine.async_llm"))
    assert "tokenizer (imported by" in bad and "input_processor" in bad and "request_stream" in bad


def test_the_demo_config_names_the_byte_tokenizers_specials():
    """demo.py writes the byte tokenizer's BOS / EOS ids itself (so the core needs no tokenizer module)."""
    from tp_overlap_plugin.serving.model.demo import demo_hf_config
    from tp_overlap_plugin.serving.model.tokenizer import ByteTokenizer

    cfg, tok = demo_hf_config(), ByteTokenizer()
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (tok.bos_token_id, tok.eos_token_id)
