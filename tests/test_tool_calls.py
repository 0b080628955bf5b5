"""Chapter 6d's tool calls: the checks of tools and tool_choice, the constraints that force a call, reading calls back
whole and streamed, and the server's chat completions with tools (12b/12c)."""
import json, random

import httpx
import openai
import pytest

from nanoserve.loader import DEFAULT_MODEL
from nanoserve.server import make_server, run_in_thread
from nanoserve.structured import FINAL, ConstraintState, compile_structured, vocabulary_bytes
from nanoserve.tokenizer import load_tokenizer
from nanoserve.engine import RequestMetrics, RequestOutput
from nanoserve.server import chat_events
from nanoserve.tool_calls import (HermesStream, Llama3JsonStream, MistralStream, PythonicStream, ToolCallStream, check_tools, held_back,
                                  parse_hermes, parse_llama3_json, parse_mistral, parse_pythonic, parse_tool_calls, template_message,
                                  tool_call, tool_call_parser, tool_choice_constraint, tool_message)

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 20}, "unit": {"enum": ["celsius", "fahrenheit"]}},
    "required": ["city", "unit"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"timezone": {"type": "string", "maxLength": 12}}, "required": ["timezone"]}}}
TOOLS = [WEATHER, CLOCK]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def follows_weather(arguments: str) -> bool:
    value = json.loads(arguments)
    return (set(value) == {"city", "unit"} and isinstance(value["city"], str) and len(value["city"]) <= 20
            and value["unit"] in ("celsius", "fahrenheit"))


@pytest.mark.parametrize("tools,match", [
    ([], "non-empty list"),
    ("get_weather", "non-empty list"),
    ([{"type": "retrieval"}], r"tools\[0\]"),
    ([{"type": "function", "function": {"name": "get weather"}}], r"tools\[0\].function.name"),
    ([{"type": "function", "function": {"name": "x" * 65}}], r"tools\[0\].function.name"),
    ([WEATHER, {"type": "function", "function": {"name": 5}}], r"tools\[1\].function.name"),
    ([WEATHER, WEATHER], "two tools have this name"),
    ([{"type": "function", "function": {"name": "f", "parameters": "{}"}}], r"tools\[0\].function.parameters"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], r"tools\[0\].function.parameters.*object"),
])
def test_bad_tools_are_value_errors_that_name_the_tool(tools, match):
    with pytest.raises(ValueError, match=match): check_tools(tools)


@pytest.mark.parametrize("tools,choice,match", [
    (TOOLS, "any", "expected 'none', 'auto', 'required'"),
    (TOOLS, {"type": "function", "function": {"name": "get_news"}}, "not among"),
    (TOOLS, {"type": "function"}, "expected"),
    (TOOLS, {"function": {"name": "get_time"}}, "expected"),
    (TOOLS, {"type": "function", "function": "get_time"}, "expected"),
    (TOOLS, {"type": "function", "function": None}, "expected"),
    ([{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 40}, "b": {"type": "integer"}}, "required": ["a", "b"]}}} for i in range(100)],
     "required", "over 100 tools needs a constraint too large"),
    (None, "required", "needs tools"),
    (None, NAMED, "not among"),
    ([{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "patternProperties": {"a": {}}}}}], "required",
     r"tools\[0\].function.parameters: .*patternProperties"),
])
def test_bad_tool_choices_are_value_errors(tools, choice, match):
    with pytest.raises(ValueError, match=match): tool_choice_constraint(tools, choice)


def test_none_and_auto_force_nothing_and_a_function_without_parameters_takes_any_object():
    assert tool_choice_constraint(TOOLS, "none") is None and tool_choice_constraint(None, "none") is None
    assert tool_choice_constraint(TOOLS, "auto") is None
    bare = [{"type": "function", "function": {"name": "ping"}}]
    assert json.loads(tool_choice_constraint(bare, {"type": "function", "function": {"name": "ping"}}).json) == {"type": "object"}


@pytest.fixture(scope="module")
def tok(): return load_tokenizer()


def random_walk(spec, tok, rng: random.Random, max_steps: int = 300) -> str:
    "Allowed tokens drawn uniformly (EOS as soon as it is allowed after 3 steps): the text."
    state, vocab, text = ConstraintState(compile_structured(spec, tok, tok.stop_token_ids, tok.vocab_size)), vocabulary_bytes(tok, tok.vocab_size), b""
    for step in range(max_steps):
        t = tok.eos_token_id if step >= 3 and state.accepts() else rng.choice(state.allowed().nonzero().flatten().tolist())
        if state.advance(t) == FINAL: return text.decode()
        text += vocab[t]
    raise AssertionError(f"no end after {max_steps} tokens: {text!r}")


@pytest.mark.parametrize("parallel", [True, False])
def test_every_forced_output_parses_into_calls_that_follow_their_schemas(tok, parallel):
    rng = random.Random(int(parallel))
    for _ in range(25):
        text = random_walk(tool_choice_constraint(TOOLS, "required", parallel), tok, rng)
        calls = parse_tool_calls(text, TOOLS, "required")
        assert calls and (parallel or len(calls) == 1), text
        for call in calls:
            arguments = json.loads(call["function"]["arguments"])
            if call["function"]["name"] == "get_weather": assert follows_weather(call["function"]["arguments"])
            else: assert call["function"]["name"] == "get_time" and set(arguments) == {"timezone"} and len(arguments["timezone"]) <= 12
        named = random_walk(tool_choice_constraint(TOOLS, NAMED, parallel), tok, rng)
        assert follows_weather(parse_tool_calls(named, TOOLS, NAMED)[0]["function"]["arguments"])


def test_reading_calls_back():
    calls = parse_tool_calls('[{"name": "get_time", "parameters": {"timezone": "UTC"}}, '
                             '{"name": "get_weather", "parameters": {"city": "Oslo", "unit": "celsius"}}]', TOOLS, "required")
    assert [c["function"]["name"] for c in calls] == ["get_time", "get_weather"]
    assert [json.loads(c["function"]["arguments"]) for c in calls] == [{"timezone": "UTC"}, {"city": "Oslo", "unit": "celsius"}]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls) and calls[0]["id"] != calls[1]["id"]
    assert parse_tool_calls('{"city": "Oslo", "unit": "celsius"}', TOOLS, NAMED)[0]["function"] == {
        "name": "get_weather", "arguments": '{"city": "Oslo", "unit": "celsius"}'}
    assert parse_tool_calls('{"city": "Os', TOOLS, NAMED) is None  # cut short (max_tokens): no call
    assert parse_tool_calls('[{"name": "get_ti', TOOLS, "required") is None


def test_messages_and_finish_reasons():
    array = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]'
    message, reason = tool_message(array, "stop", TOOLS, "required")
    assert message["content"] is None and message["tool_calls"][0]["function"]["name"] == "get_time" and reason == "tool_calls"
    assert tool_message(array[:-3], "length", TOOLS, "required") == ({"role": "assistant", "content": array[:-3]}, "length")
    message, reason = tool_message('{"city": "Oslo", "unit": "celsius"}', "stop", TOOLS, NAMED)
    assert message["tool_calls"][0]["function"]["name"] == "get_weather" and reason == "stop"  # OpenAI: a named call stops
    assert tool_message("Hello", "stop", TOOLS, "none") == ({"role": "assistant", "content": "Hello"}, "stop")
    assert tool_message("Hello", "length", None, None) == ({"role": "assistant", "content": "Hello"}, "length")


def test_streams():
    pieces = ['{"city', '": "Oslo", ', '', '"unit": "celsius"}']
    stream = ToolCallStream(TOOLS, NAMED)
    deltas = [stream.delta(p, i == len(pieces) - 1) for i, p in enumerate(pieces)]
    assert deltas[2] is None  # nothing new
    first, *rest = [d["tool_calls"][0] for d in deltas if d]
    assert first["id"].startswith("call_") and first["function"]["name"] == "get_weather" and first["index"] == 0
    assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in rest)
    assert "".join([first["function"]["arguments"], *(d["function"]["arguments"] for d in rest)]) == "".join(pieces)
    array = '[{"name": "get_time", "parameters": {"timezone": "UTC"}}]'
    stream = ToolCallStream(TOOLS, "required")
    assert stream.delta(array[:20], False) is None and stream.delta(array[20:], False) is None
    (call,) = stream.delta("", True)["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": '{"timezone": "UTC"}'}
    cut = ToolCallStream(TOOLS, "required")
    assert cut.delta(array[:20], True) == {"content": array[:20]}


def test_template_messages():
    call = tool_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    message = template_message({"role": "assistant", "content": None, "tool_calls": [call]})
    assert message["content"] == "" and message["tool_calls"][0]["function"]["arguments"] == {"city": "Oslo", "unit": "celsius"}
    assert message["tool_calls"][0]["id"] == call["id"]
    odd = template_message({"role": "assistant", "content": "x", "tool_calls": [tool_call("f", "not json")]})
    assert odd["content"] == "x" and odd["tool_calls"][0]["function"]["arguments"] == "not json"
    plain = {"role": "user", "content": "hi"}
    assert template_message(plain) is plain


# --- the server ------------------------------------------------------------------------------------------------------

TOOLS_TEMPLATE = """{%- if tools %}<|im_start|>system
{% for t in tools %}{{ t.function.name }}{{ t.function.parameters | tojson }}
{% endfor %}<|im_end|>
{% endif %}{%- for m in messages %}<|im_start|>{{ m.role }}
{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }} {{ c.function.arguments.city }}</call>{% endfor %}{% endif %}
{%- if m.role == "tool" %}[{{ m.tool_call_id }}] {% endif %}{{ m.content }}<|im_end|>
{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""
CHAT = [{"role": "user", "content": "What is the weather like in Paris?"}]


@pytest.fixture(scope="module")
def url():
    server = make_server(port=0, max_model_len=512, num_kv_blocks=200, device="cpu", log_level="warning")
    with run_in_thread(server) as u: yield u


@pytest.fixture(scope="module")
def client(url): return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def test_a_named_function_is_called_with_arguments_that_follow_its_schema(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=40)
    choice = r.choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "stop" and choice.message.content is None and call.function.name == "get_weather"
    assert follows_weather(call.function.arguments) and call.id.startswith("call_")
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                            max_tokens=40, stream=True)
    deltas = [c.choices[0] for c in stream if c.choices]
    calls = [d.delta.tool_calls[0] for d in deltas if d.delta.tool_calls]
    assert calls[0].function.name == "get_weather" and calls[0].id and all(c.id is None and c.index == 0 for c in calls[1:])
    assert "".join(c.function.arguments for c in calls) == call.function.arguments  # greedy: the same arguments, in pieces
    assert deltas[-1].finish_reason == "stop" and not any(d.delta.content for d in deltas)


@pytest.mark.parametrize("parallel", [False, None])
def test_required_makes_calls_to_the_tools(client, parallel):
    extra = {} if parallel is None else {"parallel_tool_calls": parallel}
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0,
                                       max_tokens=120, **extra)
    choice = r.choices[0]
    assert choice.finish_reason in ("tool_calls", "length")
    if choice.finish_reason == "length": assert choice.message.content and not choice.message.tool_calls; return
    assert choice.message.tool_calls and (parallel is None or len(choice.message.tool_calls) == 1)
    assert all(c.function.name in ("get_weather", "get_time") and isinstance(json.loads(c.function.arguments), dict)
               for c in choice.message.tool_calls)
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", temperature=0,
                                            max_tokens=120, stream=True, **extra)
    deltas = [c.choices[0] for c in stream if c.choices]
    streamed = [c for d in deltas for c in d.delta.tool_calls or []]
    assert [(c.function.name, c.function.arguments) for c in streamed] == [(c.function.name, c.function.arguments)
                                                                           for c in choice.message.tool_calls]
    assert deltas[-1].finish_reason == "tool_calls"


def test_a_conversation_continues_with_the_tools_result(client, url):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0, max_tokens=40)
    call = r.choices[0].message.tool_calls[0]
    conversation = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                    {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 18}'}]
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=conversation, tools=TOOLS, tool_choice="none", temperature=0, max_tokens=8)
    assert r.choices[0].message.content and not r.choices[0].message.tool_calls
    tokens = httpx.post(f"{url}/tokenize", json={"model": DEFAULT_MODEL, "messages": conversation}).json()["tokens"]
    prompt = httpx.post(f"{url}/detokenize", json={"model": DEFAULT_MODEL, "tokens": tokens}).json()["prompt"]
    assert '<|im_start|>tool\n{"temperature": 18}<|im_end|>' in prompt  # SmolLM2's template prints the result, not the call


def test_tools_and_calls_reach_a_template_that_prints_them():
    server = make_server(port=0, max_model_len=512, num_kv_blocks=64, device="cpu", log_level="warning", chat_template=TOOLS_TEMPLATE)
    with run_in_thread(server) as u:
        call = tool_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
        conversation = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]},
                        {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
        tokens = httpx.post(f"{u}/tokenize", json={"model": DEFAULT_MODEL, "messages": conversation, "tools": TOOLS}).json()["tokens"]
        prompt = httpx.post(f"{u}/detokenize", json={"model": DEFAULT_MODEL, "tokens": tokens}).json()["prompt"]
        assert 'get_weather{"type": "object"' in prompt and "get_time" in prompt  # the tools, as the template lists them
        assert "<call>get_weather Oslo</call>" in prompt  # the call's arguments reach the template as an object
        assert f"[{call['id']}] 18 C" in prompt
        r = httpx.post(f"{u}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": conversation, "tools": TOOLS,
                                                        "tool_choice": NAMED, "max_tokens": 40, "temperature": 0}, timeout=120)
        assert r.status_code == 200 and follows_weather(r.json()["choices"][0]["message"]["tool_calls"][0]["function"]["arguments"])


@pytest.mark.parametrize("body,param,words", [
    ({"tools": TOOLS}, "tool_choice", "tools without a tool_choice mean 'auto'"),  # this server has no parser
    ({"tools": TOOLS, "tool_choice": "auto"}, "tool_choice", "needs a parser"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": "auto"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_news"}}}, "tool_choice", "get_news"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}], "tool_choice": "none"}, "tools", "tools[0].function.name"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "patternProperties": {"a": {}}}}}],
      "tool_choice": "required"}, "tools", "tools[1].function.parameters"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, None, "one structured output"),
    ({"tools": TOOLS, "tool_choice": "required", "parallel_tool_calls": "no"}, "parallel_tool_calls", "boolean"),
    ({"messages": [*CHAT, {"role": "tool", "content": "18 C"}]}, "messages[1]", "tool_call_id"),
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [tool_call("f", "{}")]}]}, "messages[0]", "only the assistant"),
    ({"messages": [*CHAT, {"role": "function", "name": "f", "content": "x"}]}, "messages[1]", "'tool' message"),
    ({"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}]}, "messages[1].tool_calls[0].function", ""),
    ({"chat_template_kwargs": {"tools": TOOLS}}, "chat_template_kwargs", "tools"),
    # found by a review: once a 500, or a call cut short that looked whole
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": "get_weather"}}, "tool_choice", "expected"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": None}}, "tool_choice", "expected"),
    ({"tools": TOOLS, "tool_choice": NAMED, "stop": ['"']}, "tool_choice", "with stop"),
    ({"tools": TOOLS, "tool_choice": "required", "stop_token_ids": [5]}, "tool_choice", "with stop_token_ids"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}], "tool_choice": "none"}, "tools", "object"),
])
def test_bad_tool_requests_are_400s_that_say_why(url, body, param, words):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": CHAT, "max_tokens": 4, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_llm_chat_shows_the_tools_to_the_template_and_a_forced_call_parses():
    from nanoserve import LLM, SamplingParams
    llm = LLM(max_model_len=512, num_kv_blocks=64, device="cpu")
    call = tool_call("get_weather", '{"city": "Oslo", "unit": "celsius"}')
    conversation = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": call["id"], "content": "18 C"}]
    (out,) = llm.chat(conversation, SamplingParams(max_tokens=1), use_tqdm=False, chat_template=TOOLS_TEMPLATE, tools=TOOLS)
    assert "get_time" in out.prompt and "<call>get_weather Oslo</call>" in out.prompt and f"[{call['id']}] 18 C" in out.prompt
    forced = SamplingParams(temperature=0, max_tokens=40, structured_outputs=tool_choice_constraint(TOOLS, NAMED))
    (out,) = llm.chat(CHAT, forced, use_tqdm=False, tools=TOOLS)
    assert follows_weather(parse_tool_calls(out.text, TOOLS, NAMED)[0]["function"]["arguments"])
    with pytest.raises(ValueError, match=r"tools\[0\].function.name"):
        llm.chat(CHAT, use_tqdm=False, tools=[{"type": "function", "function": {"name": "a b"}}])
    (plain,) = llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False)
    assert llm.chat(CHAT, SamplingParams(max_tokens=1), use_tqdm=False, tools=[])[0].prompt == plain.prompt  # [] is no tools


def test_every_choice_of_n_is_a_call(client):
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, n=3, seed=1, max_tokens=40)
    assert len(r.choices) == 3 and all(follows_weather(c.message.tool_calls[0].function.arguments) for c in r.choices)
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, n=3, seed=1,
                                            max_tokens=40, stream=True)
    arguments = {}
    for c in stream:
        for choice in c.choices:
            for call in choice.delta.tool_calls or []: arguments[choice.index] = arguments.get(choice.index, "") + call.function.arguments
    assert [arguments[i] for i in range(3)] == [c.message.tool_calls[0].function.arguments for c in r.choices]  # seeded: the same


# --- 'auto': the Hermes format ----------------------------------------------------------------------------------------

HERMES = ('Let me look.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_time", "arguments": {"timezone": "CET"}}\n</tool_call>')
TEXTS = [HERMES, "A plain answer, with < and <tool and <tool_ca inside.", '<tool_call>{"name": "f"}</tool_call>',
         'x<tool_call>{"name": "f", "arguments": "{}"}</tool_call> after', "<tool_call>{not json}</tool_call>",
         'cut <tool_call>{"name": "f", "argu', "<tool_c",
         '<tool_call>{"name": "f"}</tool_call>\n<tool_call>oops</tool_call> then <tool_call>{"name": "g"}</tool_call>',  # found by a review
         '<tool_call>{"name": "f"}</tool_call><tool_call>{"name": "g', 'A<tool_call>bad</tool_call>B<tool_call>{"name": "g"}</tool_call>']


def named_calls(calls) -> list: return [(c["function"]["name"], c["function"]["arguments"]) for c in calls or []]


def test_parse_hermes():
    content, calls = parse_hermes(HERMES)
    assert content == "Let me look." and named_calls(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                                                ("get_time", '{"timezone": "CET"}')]
    content, calls = parse_hermes('<tool_call>{"name": "f"}</tool_call>')
    assert content is None and named_calls(calls) == [("f", "{}")]
    for text in ["no calls", "<tool_call>{bad}</tool_call>", '<tool_call>["f"]</tool_call>', "<tool_call>unclosed", TEXTS[-1]]:
        assert parse_hermes(text) == (text, None)
    assert named_calls(parse_hermes(TEXTS[-3])[1]) == [("f", "{}")]  # a broken block ends the calls, the rest dropped
    assert parse_hermes(TEXTS[-2])[0] is None and named_calls(parse_hermes(TEXTS[-2])[1]) == [("f", "{}")]
    assert [held_back(t, "<tool_call>") for t in ("abc<tool_c", "abc<", "abc", "<tool_call")] == [7, 1, 0, 10]
    with pytest.raises(ValueError, match="tool call parser 'llama3'"): tool_call_parser("llama3")


LLAMA_TEXTS = ['{"name": "get_weather", "parameters": {"city": "Paris", "unit": "celsius"}}',
               '<|python_tag|>{"name": "get_time", "arguments": {"timezone": "CET"}}; {"name": "get_weather", "parameters": {}}',
               "  The weather is nice.", "{not json", '{"name": "f"} and then prose', " ", "<|python", '\n{"name": "f", "parameters": {"a": "b"}};']


def test_parse_llama3_json():
    content, calls = parse_llama3_json(LLAMA_TEXTS[1])
    assert content is None and named_calls(calls) == [("get_time", '{"timezone": "CET"}'), ("get_weather", "{}")]
    assert named_calls(parse_llama3_json(LLAMA_TEXTS[7])[1]) == [("f", '{"a": "b"}')]
    for text in LLAMA_TEXTS[2:7]: assert parse_llama3_json(text) == (text, None)
    message, reason = tool_message(LLAMA_TEXTS[0], "stop", TOOLS, "auto", "llama3_json")
    assert message["content"] is None and follows_weather(message["tool_calls"][0]["function"]["arguments"]) and reason == "tool_calls"


def check_streams_in_pieces(parse, stream_class, text: str, seeds: int = 60):
    "Streamed in random pieces, `text` gives the content and the calls that `parse` finds in it whole (or, without calls, the text)."
    want_content, want_calls = parse(text)
    for seed in range(seeds):
        rng = random.Random(seed)
        cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(1, 8))))
        pieces = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]
        stream = stream_class()
        deltas = [d for i, p in enumerate(pieces) if (d := stream.delta(p, i == len(pieces) - 1))]
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert ("".join(d.get("content", "") for d in deltas) or None) == (want_content if want_calls else text or None), pieces
        assert named_calls(calls) == named_calls(want_calls) and [c["index"] for c in calls] == list(range(len(calls)))


@pytest.mark.parametrize("text", LLAMA_TEXTS)
def test_a_llama3_json_stream_in_any_pieces_says_what_the_whole_text_says(text):
    check_streams_in_pieces(parse_llama3_json, Llama3JsonStream, text)


@pytest.mark.parametrize("text", TEXTS)
def test_a_hermes_stream_in_any_pieces_says_what_the_whole_text_says(text):
    check_streams_in_pieces(parse_hermes, HermesStream, text)


def test_a_call_needs_a_valid_name_and_arguments_that_are_an_object():
    for block in ['{"name": "f", "arguments": [1]}', '{"name": "f", "arguments": "[1]"}', '{"name": "f", "arguments": "{bad"}',
                  '{"name": "no spaces", "arguments": {}}', '{"name": "", "arguments": {}}', '{"name": "f", "arguments": 3}']:
        text = f"<tool_call>{block}</tool_call>"
        assert parse_hermes(text) == (text, None), block
    assert parse_llama3_json('{"name": "f", "parameters": [1]}')[1] is None
    assert named_calls(parse_hermes('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')[1]) == [("f", '{"a": 1}')]
    deep = "[" * 5000 + "]" * 5000  # past Python's recursion limit: text, not a RecursionError (a review found the 500)
    for parse, text in ((parse_hermes, f'<tool_call>{{"name": "f", "arguments": {deep}}}</tool_call>'), (parse_llama3_json, f'{{"name": "f", "parameters": {deep}}}'),
                        (parse_mistral, f"[TOOL_CALLS]{deep}"), (parse_mistral, f"[TOOL_CALLS]f[ARGS]{deep}"), (parse_pythonic, f"[f(a={deep})]")):
        assert parse(text) == (text, None)
    assert template_message({"role": "assistant", "tool_calls": [tool_call("f", deep)]})["tool_calls"][0]["function"]["arguments"] == deep


def test_arguments_a_client_could_not_read_make_text():
    "NaN and infinities (which Python's json reads) and lone surrogates (which UTF-8 cannot hold) are no call: text."
    for parse, text in ((parse_mistral, '[TOOL_CALLS]f[ARGS]{"a": NaN}'), (parse_hermes, '<tool_call>{"name": "f", "arguments": {"a": -Infinity}}</tool_call>'),
                        (parse_llama3_json, '{"name": "f", "parameters": {"a": 1e999}}'), (parse_hermes, '<tool_call>{"name": "f", "arguments": {"a": "\\ud800"}}</tool_call>'),
                        (parse_pythonic, '[f(city="\\ud83d")]')):
        assert parse(text) == (text, None), text
    emoji = parse_pythonic('[f(city="\\ud83d\\ude00 \\d")]')[1][0]["function"]["arguments"]  # JSON's escapes of an emoji, joined
    assert json.loads(emoji) == {"city": "\U0001F600 \\d"}
    _, calls = parse_mistral('[TOOL_CALLS] [{"name": "f", "arguments": {}}, {"name": "g", "arguments": {}}]')
    assert all(len(c["id"]) == 9 and c["id"].isalnum() for c in calls) and calls[0]["id"] != calls[1]["id"]  # Mistral's templates ask for 9


# --- 'auto': the pythonic format (Llama 3.2, Llama 4) and Mistral's ------------------------------------------------------

PYTHONIC_TEXTS = ['[get_weather(city="Paris", unit="celsius"), get_time(timezone="CET")]',
                  '<|python_start|>[f(a=-1, b=(1, 2.5), c={"k": [None, True]}, d=null, e=\'é\')]<|python_end|>',
                  '  [f()]  ', "[link](http://x) is prose", "[f(x)]", "[f(a=g())]", "[f(a=x)]", "[os.system(cmd='ls')]",
                  "[f(**{'a': 1})]", "[f(a={1: 2})]", "[f(a={1, 2})]", "[f(a=1e999)]", "[f(a=b'x')]", "[f(a=1j)]", "[]",
                  "[f(a=1)", "[f(a=1, a=2)]", "[f(a=-True)]", "Sunny.", "<|python_st", "[f(a=1)] and more"]


def test_parse_pythonic():
    content, calls = parse_pythonic(PYTHONIC_TEXTS[0])
    assert content is None and named_calls(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}'),
                                                       ("get_time", '{"timezone": "CET"}')]
    assert named_calls(parse_pythonic(PYTHONIC_TEXTS[1])[1]) == [("f", '{"a": -1, "b": [1, 2.5], "c": {"k": [null, true]}, "d": null, "e": "é"}')]
    assert named_calls(parse_pythonic(PYTHONIC_TEXTS[2])[1]) == [("f", "{}")]
    for text in PYTHONIC_TEXTS[3:]: assert parse_pythonic(text) == (text, None), text  # not a list of calls with literals: text
    deep = "[f(a=" + "[" * 300 + "]" * 300 + ")]"
    assert parse_pythonic(deep) == (deep, None)  # Python's parser refuses the nesting; no RecursionError escapes
    message, reason = tool_message(PYTHONIC_TEXTS[0], "stop", TOOLS, "auto", "pythonic")
    assert message["content"] is None and follows_weather(message["tool_calls"][0]["function"]["arguments"]) and reason == "tool_calls"


MISTRAL_TEXTS = ['[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}, {"name": "get_time"}]',
                 'Let me check.[TOOL_CALLS]get_time[ARGS]{"timezone": "CET"}[TOOL_CALLS]get_weather[ARGS]{"city": "Oslo"}',
                 "No calls [TOOL here, [ARGS] neither.", "[TOOL_CALLS]", "[TOOL_CALLS] []", "[TOOL_CALLS] [1, 2]",
                 '[TOOL_CALLS]f[ARGS]{"a": 1} and prose', "[TOOL_CALLS]f[ARGS][1]", "[TOOL_CALLS]f{}", 'x[TOOL_CALLS]bad name[ARGS]{}',
                 '[TOOL_CALLS] [{"name": "f", "arguments": {}}', "[TOOL_", '[TOOL_CALLS]get_time[ARGS]{"timezone": "CET"}[TOOL_CALLS]g']


def test_parse_mistral():
    content, calls = parse_mistral(MISTRAL_TEXTS[0])
    assert content is None and named_calls(calls) == [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]
    content, calls = parse_mistral(MISTRAL_TEXTS[1])
    assert content == "Let me check." and named_calls(calls) == [("get_time", '{"timezone": "CET"}'), ("get_weather", '{"city": "Oslo"}')]
    for text in MISTRAL_TEXTS[2:]: assert parse_mistral(text) == (text, None), text


@pytest.mark.parametrize("parse,stream_class,text", [(parse_pythonic, PythonicStream, t) for t in PYTHONIC_TEXTS]
                         + [(parse_mistral, MistralStream, t) for t in MISTRAL_TEXTS])
def test_pythonic_and_mistral_streams_in_any_pieces_say_what_the_whole_text_says(parse, stream_class, text):
    check_streams_in_pieces(parse, stream_class, text, seeds=30)


@pytest.fixture(scope="module")
def mistral_url():
    server = make_server(port=0, max_model_len=512, num_kv_blocks=64, device="cpu", log_level="warning", tool_call_parser="mistral")
    with run_in_thread(server) as u: yield u


def test_a_parser_whose_tags_are_special_tokens_sees_them_in_the_text(mistral_url, hermes_url):
    "Mistral's [TOOL_CALLS] is a special token: with that parser an 'auto' request keeps special tokens in its text, as in vLLM."
    start = load_tokenizer().backend.token_to_id("<|im_start|>")  # a special token of SmolLM2's, forced with logit_bias
    body = {"model": DEFAULT_MODEL, "messages": CHAT, "max_tokens": 2, "logit_bias": {str(start): 100}, "tools": TOOLS}
    content = {}
    for name, url in (("mistral", mistral_url), ("hermes", hermes_url)):
        for choice in ("auto", "none"):
            r = httpx.post(f"{url}/v1/chat/completions", json={**body, "tool_choice": choice}, timeout=120)
            assert r.status_code == 200, r.text
            content[name, choice] = r.json()["choices"][0]["message"]["content"]
    assert content["mistral", "auto"] == "<|im_start|><|im_start|>"
    assert not content["mistral", "none"] and not content["hermes", "auto"]  # skipped, the default


def test_auto_messages_and_streams_through_the_server_code():
    message, reason = tool_message(HERMES, "stop", TOOLS, "auto", "hermes")
    assert message["content"] == "Let me look." and len(message["tool_calls"]) == 2 and reason == "tool_calls"
    assert tool_message("Sunny.", "stop", TOOLS, "auto", "hermes") == ({"role": "assistant", "content": "Sunny."}, "stop")
    with pytest.raises(ValueError, match="tool call parser None"): tool_message(HERMES, "stop", TOOLS, "auto")

    async def outputs():  # the engine's cumulative outputs of one choice, a few characters at a time
        for end in [*range(5, len(HERMES), 7), len(HERMES)]:
            yield RequestOutput("r", None, [1, 2], HERMES[:end], list(range(end)), end == len(HERMES), "stop" if end == len(HERMES) else None,
                                RequestMetrics(0.0))

    async def events(): return [e async for e in chat_events([outputs()], "rid", "m", None, False, tools=TOOLS, tool_choice="auto", parser="hermes")]
    import asyncio
    chunks = [json.loads(e.removeprefix("data: ")) for e in asyncio.run(events()) if e.strip() != "data: [DONE]"]
    deltas = [c["choices"][0] for c in chunks]
    assert "".join(d["delta"].get("content") or "" for d in deltas) == "Let me look."
    assert named_calls(c for d in deltas for c in d["delta"].get("tool_calls", [])) == named_calls(message["tool_calls"])
    assert deltas[-1]["finish_reason"] == "tool_calls"


@pytest.fixture(scope="module")
def hermes_url():
    server = make_server(port=0, max_model_len=512, num_kv_blocks=64, device="cpu", log_level="warning", tool_call_parser="hermes")
    with run_in_thread(server) as u: yield u


def test_a_server_with_a_parser_takes_auto(hermes_url):
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        r = httpx.post(f"{hermes_url}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": CHAT, "max_tokens": 12,
                                                                  "temperature": 0, **body}, timeout=120)
        assert r.status_code == 200, r.text
        choice = r.json()["choices"][0]
        assert choice["message"]["content"] and not choice["message"].get("tool_calls")  # SmolLM2 answers in prose
    with pytest.raises(ValueError, match="tool call parser 'xml'"):
        make_server(port=0, device="cpu", tool_call_parser="xml")



def test_review_findings_that_are_now_200s(client, url):
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": DEFAULT_MODEL, "messages": CHAT, "max_tokens": 3, "tools": []}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"]  # [] is no tools, as in vLLM
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice="required", max_tokens=80,
                                       temperature=0, response_format={"type": "text"}, parallel_tool_calls=False)
    assert r.choices[0].finish_reason in ("tool_calls", "length")  # a text response_format constrains nothing


def test_a_streamed_call_with_logprobs_finishes_once(client):
    stream = client.chat.completions.create(model=DEFAULT_MODEL, messages=CHAT, tools=TOOLS, tool_choice=NAMED, temperature=0,
                                            max_tokens=40, stream=True, logprobs=True, stream_options={"include_usage": True})
    chunks = list(stream)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    logprobs = [lp for c in chunks if c.choices and c.choices[0].logprobs for lp in c.choices[0].logprobs.content]
    assert finishes == ["stop"] and len(logprobs) == chunks[-1].usage.completion_tokens


def test_llm_chat_refuses_malformed_tool_calls_by_place():
    from nanoserve import LLM
    llm = LLM(max_model_len=256, num_kv_blocks=32, device="cpu")
    for calls in ([{"id": "x"}], ["abc"], [{"id": "x", "function": {"name": "f"}}]):
        with pytest.raises(ValueError, match=r"conversation 0: tool_calls\[0\]"):
            llm.chat([*CHAT, {"role": "assistant", "content": None, "tool_calls": calls}], use_tqdm=False)
