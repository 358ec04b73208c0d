"""Tool calls without a model: the parsers (serving/entrypoints/openai/tool_parsers.py) on crafted
replies, streamed piece by piece and whole; the chat request schema against the OpenAI SDK's own types
(every field listed, a reply's `message.model_dump()` accepted back); what each tool_choice plans
(serving/entrypoints/openai/chat_tools.py); the demo template's tools; the server's tool flags."""

import json
import typing

import openai
import pytest
from pydantic import ValidationError

from tp_overlap_plugin.serving.entrypoints.openai.chat_tools import plan_tools
from tp_overlap_plugin.serving.entrypoints.openai.protocol import ChatCompletionRequest
from tp_overlap_plugin.serving.entrypoints.openai.server_errors import ApiError, describe_validation_errors
from tp_overlap_plugin.serving.entrypoints.openai.tool_parsers import (PARSERS, HermesToolParser,
                                                                       Llama3JsonToolParser, NamedCallParser,
                                                                       RequiredCallsParser, ToolCallStream,
                                                                       get_parser)
from tp_overlap_plugin.serving.model.tokenizer import ByteTokenizer

W_ARGS = '{"city": "Paris", "days": [1, 2], "note": "a \\"quoted\\" }"}'

# (reply text, content, [(name, arguments)]) for the hermes format
HERMES = [
    ("Just text, no call.", "Just text, no call.", []),
    ("  leading and trailing space \n", "  leading and trailing space \n", []),
    ("a < b, and <tool is not a tag", "a < b, and <tool is not a tag", []),
    (f'<tool_call>\n{{"name": "w", "arguments": {W_ARGS}}}\n</tool_call>', "", [("w", W_ARGS)]),
    (f'Let me check.\n<tool_call>\n{{"name": "w", "arguments": {W_ARGS}}}\n</tool_call>\n'
     f'<tool_call>\n{{"name": "t", "arguments": {{}}}}\n</tool_call>', "Let me check.", [("w", W_ARGS), ("t", "{}")]),
    ('<tool_call>{"arguments": {"x": 1}, "name": "late_name"}</tool_call>', "", [("late_name", '{"x": 1}')]),
    ('<tool_call>{"name": "s", "arguments": "{\\"x\\": 1}"}</tool_call>', "", [("s", '{"x": 1}')]),
    ("before <tool_call>not json</tool_call> after", "before <tool_call>not json</tool_call> after", []),
    ('x <tool_call>{"name": "w", "arguments": {"a": 1}} trailing junk</tool_call>', "x", [("w", '{"a": 1}')]),
    ('<tool_call>{"name": "w", "arguments": {"a": 1} no closing brace</tool_call>', "", [("w", '{"a": 1}')]),
    ('<tool_call>{"name": "w", "arguments": {"a": 1}}', "", [("w", '{"a": 1}')]),          # ended without the tag
    ('A <tool_call>{"name": "w", "arguments": {}}</tool_call> B', "A\nB", [("w", "{}")]),
]

LLAMA3 = [
    ("Plain answer.", "Plain answer.", []),
    ('{"name": "w", "parameters": ' + W_ARGS + "}", "", [("w", W_ARGS)]),
    ('<|python_tag|>{"name": "a", "parameters": {}}; {"name": "b", "arguments": {"k": "v"}}', "",
     [("a", "{}"), ("b", '{"k": "v"}')]),
    ('  {"result": 5}', '  {"result": 5}', []),                  # JSON, but no call
    ('{"name": "w", "parameters": {"a": 1}} and then prose', "and then prose", [("w", '{"a": 1}')]),
    ("Use {braces} later", "Use {braces} later", []),
]


def _stream(parser, text, chunks):
    """What a client assembles from the deltas of `text` pushed in pieces of `chunks` characters."""
    stream = ToolCallStream(parser)
    content, calls = "", {}
    pieces = [text[i:i + chunks] for i in range(0, len(text), chunks)] or [""]
    for i, piece in enumerate(pieces + [""]):
        c, deltas = stream.push(piece, final=i == len(pieces))
        content += c
        for d in deltas:
            if d.index not in calls:
                # A call's first delta carries its id, type and name; later ones only arguments.
                assert d.id.startswith("call_") and d.type == "function" and d.function.name
                calls[d.index] = [d.function.name, ""]
            else:
                assert d.id is None and d.type is None and d.function.name is None and d.function.arguments
            calls[d.index][1] += d.function.arguments
    return content, [tuple(calls[i]) for i in sorted(calls)]


@pytest.mark.parametrize("parser,cases", [(HermesToolParser(), HERMES), (Llama3JsonToolParser(), LLAMA3)],
                         ids=["hermes", "llama3_json"])
def test_parsers_on_crafted_replies_streamed_and_whole(parser, cases):
    for text, content, calls in cases:
        snap = parser.snapshot(text, final=True)
        assert (snap.content, [(c.name, c.arguments) for c in snap.calls]) == (content, calls), text
        for c in snap.calls:
            json.loads(c.arguments)
        for chunk in (1, 3, 7, len(text) or 1):
            # Streamed, the same content and calls arrive, and nothing of a call's text leaks into content.
            assert _stream(parser, text, chunk) == (content, calls), (text, chunk)


def test_streamed_arguments_come_in_pieces_and_partial_calls_are_not_replies():
    stream = ToolCallStream(HermesToolParser())
    text = '<tool_call>{"name": "w", "arguments": {"city": "Paris", "days": 3}}</tool_call>'
    pieces = [d for i in range(len(text)) for d in stream.push(text[i])[1]]
    assert len(pieces) > 5 and pieces[0].function.name == "w"
    assert "".join(p.function.arguments for p in pieces) == '{"city": "Paris", "days": 3}'
    # Cut by max_tokens: the whole reply has no call (its JSON never closed); hermes shows the text instead.
    cut = '<tool_call>{"name": "w", "arguments": {"city": "Par'
    assert HermesToolParser().snapshot(cut, final=True).calls == []
    assert HermesToolParser().snapshot(cut, final=True).content == cut


def test_forced_call_parsers():
    named = NamedCallParser("w")
    assert [(c.name, c.arguments) for c in named.snapshot('{"a": 1}', True).calls] == [("w", '{"a": 1}')]
    assert named.snapshot('{"a": ', True).calls == []
    assert _stream(named, '{"a": [1, 2]}', 2) == ("", [("w", '{"a": [1, 2]}')])
    req = RequiredCallsParser()
    text = '[{"name": "w", "arguments": {"a": 1}}, {"name": "t", "arguments": {}}]'
    assert _stream(req, text, 1) == ("", [("w", '{"a": 1}'), ("t", "{}")])
    assert [c.name for c in req.snapshot(text[:-10], True).calls] == ["w"]   # the cut call is dropped


def test_parser_registry_and_server_flags():
    assert set(PARSERS) >= {"hermes", "llama3_json"}
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; choose one of hermes, llama3_json"):
        get_parser("mistral")
    from tp_overlap_plugin.cli.serve import tool_parser_from_args
    from tp_overlap_plugin.serving.user_errors import CliError
    from tp_overlap_plugin.cli.main import build_parser   # the tp-overlap command's parser

    p = build_parser()
    assert tool_parser_from_args(p.parse_args(["serve"])) is None
    assert tool_parser_from_args(p.parse_args(["serve", "--tool-call-parser", "hermes"])) is None
    on = p.parse_args(["serve", "--enable-auto-tool-choice", "--tool-call-parser", "llama3_json"])
    assert tool_parser_from_args(on) == "llama3_json"
    with pytest.raises(CliError, match="needs --tool-call-parser"):
        tool_parser_from_args(p.parse_args(["serve", "--enable-auto-tool-choice"]))


def test_unknown_parser_is_a_usage_error_listing_the_choices(capsys):
    from tp_overlap_plugin.cli.main import build_parser   # the tp-overlap command's parser

    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", "--tool-call-parser", "mistral"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "invalid choice: 'mistral'" in err and "hermes" in err and "llama3_json" in err


# ---- the request schema against the OpenAI SDK's types ----------------------------------------------
def _keys(td) -> set:
    return set(typing.get_type_hints(td))


def test_every_field_of_the_sdk_request_and_message_types_is_listed():
    from openai.types.chat import completion_create_params as params
    import openai.types.chat as t

    from openai.types import completion_create_params as completion_params

    from tp_overlap_plugin.serving.entrypoints.openai.protocol import CompletionRequest

    assert _keys(params.CompletionCreateParamsBase) - set(ChatCompletionRequest.model_fields) == set()
    assert _keys(completion_params.CompletionCreateParamsBase) - set(CompletionRequest.model_fields) == set()
    from tp_overlap_plugin.serving.entrypoints.openai.protocol import StreamOptions

    assert _keys(t.ChatCompletionStreamOptionsParam) - set(StreamOptions.model_fields) == set()
    from tp_overlap_plugin.serving.entrypoints.openai import chat_messages as m

    for sdk, ours in [(t.ChatCompletionSystemMessageParam, m.SystemMessage), (t.ChatCompletionUserMessageParam, m.UserMessage),
                      (t.ChatCompletionAssistantMessageParam, m.AssistantMessage), (t.ChatCompletionToolMessageParam, m.ToolMessage),
                      (t.ChatCompletionFunctionMessageParam, m.FunctionMessage), (t.ChatCompletionContentPartTextParam, m.TextContentPart),
                      (t.ChatCompletionFunctionToolParam, m.ChatTool), (t.ChatCompletionMessage, m.AssistantMessage)]:
        keys = set(sdk.model_fields) if hasattr(sdk, "model_fields") else _keys(sdk)
        assert keys - set(ours.model_fields) == set(), sdk.__name__


def _req(**kw):
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **kw})


def _error(**kw):
    with pytest.raises(ValidationError) as e:
        _req(**kw)
    return describe_validation_errors(e.value.errors())


def test_a_replys_model_dump_and_the_sdks_nulls_are_accepted():
    reply = openai.types.chat.ChatCompletion.model_validate({
        "id": "x", "object": "chat.completion", "created": 0, "model": "demo",
        "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
            "role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": '{"a": 1}'}}]}}]})
    dumped = reply.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    msgs = [{"role": "system", "content": "s", "name": "n"}, {"role": "user", "content": "hi", "name": "u"}, dumped,
            {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "sunny"}]},
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "no"}]},
            {"role": "function", "name": "w", "content": None},
            {"role": "assistant", "content": "ok", "reasoning_content": None, "reasoning": "because"}]
    req = ChatCompletionRequest.model_validate({
        "messages": msgs, "prediction": None, "audio": None, "modalities": ["text"], "web_search_options": None,
        "moderation": None, "functions": None, "function_call": "none", "n": None, "logprobs": None,
        "stream": None, "parallel_tool_calls": True, "store": False, "metadata": {"k": "v"}, "service_tier": "fast",
        "verbosity": "low", "prompt_cache_retention": "24h", "prompt_cache_options": {"mode": "implicit"},
        "reasoning_effort": "xhigh"})
    assert req.n == 1 and not req.logprobs
    rendered = [m.for_template() for m in req.messages]
    assert rendered[2] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "w", "arguments": {"a": 1}}}]}
    assert rendered[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}
    assert rendered[4]["content"] == "no" and rendered[5] == {"role": "tool", "content": "", "name": "w"}
    assert rendered[6] == {"role": "assistant", "content": "ok", "reasoning_content": "because"}


@pytest.mark.parametrize("kw,param,fragment", [
    (dict(audio={"format": "wav", "voice": "alloy"}), "audio", "produces no audio"),
    (dict(modalities=["text", "audio"]), "modalities", "only the 'text' modality"),
    (dict(web_search_options={}), "web_search_options", "searches nothing"),
    (dict(functions=[{"name": "f"}]), "functions", "send them as 'tools'"),
    (dict(function_call={"name": "f"}), "function_call", "named function_call"),
    (dict(tool_choice={"type": "custom", "custom": {"name": "f"}}), "tool_choice", "type 'custom' is not supported"),
    (dict(tool_choice="sometimes"), "tool_choice", "not 'sometimes'"),
    (dict(tools=[{"type": "custom", "custom": {"name": "f"}}]), "tools.0", "tools of type 'custom'"),
    (dict(tools=[{"type": "function", "function": {"name": "bad name!"}}]), "tools.0.function.name", "pattern"),
    (dict(messages=[{"role": "tool", "content": "x"}]), "messages.0.tool_call_id", "missing required"),
    (dict(messages=[{"role": "assistant", "audio": {"id": "a1"}}]), "messages.0.audio", "no audio"),
    (dict(messages=[{"role": "assistant", "tool_calls": [{"id": "c", "type": "custom", "custom": {}}]}]),
     "messages.0.tool_calls.0", "tool calls of type 'custom'"),
])
def test_what_cannot_be_honoured_is_refused_naming_the_field(kw, param, fragment):
    msg, got = _error(**kw)
    assert got == param and fragment in msg, msg


TOOLS = [{"type": "function", "function": {"name": "w", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
         {"type": "function", "function": {"name": "t"}}]


def test_tool_choice_plans():
    assert plan_tools(_req(), None).template_tools is None
    none = plan_tools(_req(tools=TOOLS, tool_choice="none"), None)
    assert none.parser is None and [t["function"]["name"] for t in none.template_tools] == ["w", "t"]
    auto = plan_tools(_req(tools=TOOLS), "hermes")
    assert isinstance(auto.parser, HermesToolParser) and not auto.forced
    assert plan_tools(_req(tools=TOOLS, parallel_tool_calls=False), "hermes").max_calls == 1
    named = plan_tools(_req(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "t"}}), None)
    assert named.structured_output == {"json_schema": {"type": "object", "properties": {}}}
    required = plan_tools(_req(tools=TOOLS, tool_choice="required", parallel_tool_calls=False), None)
    schema = required.structured_output["json_schema"]
    assert schema["minItems"] == schema["maxItems"] == 1 and len(schema["items"]["anyOf"]) == 2
    allowed = plan_tools(_req(tools=TOOLS, tool_choice={"type": "allowed_tools", "allowed_tools": {
        "mode": "required", "tools": [{"type": "function", "function": {"name": "t"}}]}}), None)
    assert [t["function"]["name"] for t in allowed.template_tools] == ["t"]
    assert len(allowed.structured_output["json_schema"]["items"]["anyOf"]) == 1


@pytest.mark.parametrize("kw,auto,param,fragment", [
    (dict(tools=TOOLS), None, "tool_choice", "--enable-auto-tool-choice"),
    (dict(tools=TOOLS, tool_choice="auto"), None, "tool_choice", "--enable-auto-tool-choice"),
    (dict(tool_choice="required"), None, "tool_choice", "needs tools"),
    (dict(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "x"}}), None, "tool_choice",
     "'x', which is not among the tools (w, t)"),
    (dict(tools=TOOLS + TOOLS[:1]), "hermes", "tools", "tools[2]: the function name 'w' is listed twice"),
    (dict(tools=TOOLS, tool_choice="required", stop=["}"]), None, "stop", "would cut"),
    (dict(tools=TOOLS, tool_choice="required", response_format={"type": "json_object"}), None, "response_format",
     "cannot be combined"),
    (dict(tools=[{"type": "function", "function": {"name": "n", "parameters": {"not": {"type": "string"}}}}],
          tool_choice="required"), None, "tools", "tools[0].function.parameters.not"),
])
def test_tool_choice_errors(kw, auto, param, fragment):
    with pytest.raises(ApiError) as e:
        plan_tools(_req(**kw), auto)
    assert e.value.status == 400 and e.value.param == param and fragment in e.value.message, e.value.message


def test_demo_template_renders_tools_calls_and_results():
    tok = ByteTokenizer()
    plain = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    # Plain chats are rendered exactly as before tools existed (served outputs are compared against it).
    assert tok.apply_chat_template(plain) == "<|system|>Be brief.<|end|><|user|>Hi<|end|><|assistant|>"
    assert tok.apply_chat_template(plain, tools=[]) == tok.apply_chat_template(plain)
    req = _req(messages=[{"role": "user", "content": "Hi"},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=TOOLS)
    text = tok.apply_chat_template([m.for_template() for m in req.messages],
                                   tools=[t.for_template() for t in req.tools])
    assert text.startswith("<|system|># Tools\n<tools>\n" + json.dumps(TOOLS[0]))
    assert '<|assistant|><tool_call>{"name": "w", "arguments": {"city": "P"}}</tool_call><|end|>' in text
    assert text.endswith("<|user|><tool_response>\nsunny\n</tool_response><|end|><|assistant|>")
    # The demo's own call format is what the hermes parser reads.
    call = text.split("<|assistant|>")[1].removesuffix("<|end|>")
    assert [(c.name, c.arguments) for c in HermesToolParser().snapshot(call, True).calls] == [("w", '{"city": "P"}')]


QWEN_LIKE = ("{% if tools %}<tools>{% for t in tools %}{{ t.function.name }};{% endfor %}</tools>{% endif %}"
             "{% for m in messages %}{% if m.role == 'tool' %}<response>{{ m.content }}</response>"
             "{% else %}<{{ m.role }}>{{ m.content }}{% for c in m.tool_calls or [] %}"
             "{% if loop.index > 1 %}{{ raise_exception('one call at a time') }}{% endif %}"
             "<call>{{ c.function.arguments | tojson }}</call>{% endfor %}{% endif %}{% endfor %}")


def test_hf_templates_get_tools_and_call_arguments_as_objects(tmp_path):
    """A Hugging Face template gets the tools, and a call's arguments as an object (`tojson` writes them
    once, not as a quoted string); its own raise_exception is a ValueError (the server's 400)."""
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    from tp_overlap_plugin.serving.engine.input_processor import InputProcessor
    from tp_overlap_plugin.serving.model.tokenizer import HFTokenizer

    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(["tools and calls"] * 4, vocab_size=260, min_frequency=1, special_tokens=["<|eos|>"])
    PreTrainedTokenizerFast(tokenizer_object=bpe._tokenizer, eos_token="<|eos|>",
                            chat_template=QWEN_LIKE).save_pretrained(str(tmp_path))
    proc = InputProcessor(HFTokenizer(tmp_path), 300, 128, structured=None, eos_ids=set())
    call = {"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}
    req = _req(messages=[{"role": "user", "content": "hi"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}], tools=TOOLS)
    text = proc.chat_text([m.for_template() for m in req.messages], False, [t.for_template() for t in req.tools])
    assert text == '<tools>w;t;</tools><user>hi<assistant><call>{"city": "P"}</call><response>sunny</response>'
    assert proc.chat_text([{"role": "user", "content": "hi"}], False) == "<user>hi"     # no tools: no section
    two = _req(messages=[{"role": "assistant", "content": None, "tool_calls": [call, call]}])
    with pytest.raises(ValueError, match="the chat template rejected the messages: one call at a time"):
        proc.chat_text([m.for_template() for m in two.messages], False)
