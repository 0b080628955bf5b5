import json, shutil, subprocess, sys
from functools import lru_cache
from pathlib import Path

import pytest
import tokenizers
from hypothesis import HealthCheck, given, settings, strategies as st

from nanoserve.loader import default_model_dir
from nanoserve.testing import hf_default_model_dir, quiet_transformers
from nanoserve.tokenizer import IncrementalDetokenizer, Tokenizer, load_tokenizer

TEXTS = ["Hello world!", "  leading spaces, 2024 digits and 3.14159", "café, naïve, Ærø, Straße", "日本語のテキストと中文",
         "emoji 🙂👍🏽🇫🇷 and ZWJ 👩‍👩‍👧", "<|im_start|>user\nHi<|im_end|>\n", "code:\n\tdef f(x):\n\t\treturn x**2\r\n", "",
         "<|im_end", "\u00a0non-breaking\u2009thin space", "a\u0301 combining accent"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a concise geography tutor."}, {"role": "user", "content": "Capital of France?"},
     {"role": "assistant", "content": "Paris."}, {"role": "user", "content": "And of Japan? 日本"}],
    [{"role": "system", "content": "Réponds en français 🇫🇷."}, {"role": "user", "content": "Merci!"}],
]
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Météo d'une ville <ville>",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}
TOOL_CHAT = [{"role": "user", "content": "Weather in Zürich?"},
             {"role": "assistant", "content": None, "tool_calls": [
                 {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Zürich"}}}]},
             {"role": "tool", "content": "12 °C"}]

QWEN3_STYLE_TEMPLATE = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0].role == 'system' %}
        {{- messages[0].content + '\\n\\n' }}
    {%- endif %}
    {{- "# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- if message.role == "user" and message.content is string %}
        {%- set ns.last_query_index = messages|length - 1 - loop.index0 %}
        {%- break %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content if message.content is string else '' %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning = '' %}
        {%- if '</think>' in content %}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1].strip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {%- if loop.index0 > ns.last_query_index and reasoning %}
            {{- '<|im_start|>assistant\\n<think>\\n' + reasoning + '\\n</think>\\n\\n' + content }}
        {%- else %}
            {{- '<|im_start|>assistant\\n' + content }}
        {%- endif %}
        {%- for call in message.tool_calls or [] %}
            {{- '\\n<tool_call>\\n' + {"name": call.function.name, "arguments": call.function.arguments} | tojson + '\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}
    {%- elif not (message.role == "system" and loop.first) %}
        {{- raise_exception('Unexpected message role: ' + message.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\\n\\n</think>\\n\\n' }}
    {%- endif %}
{%- endif %}"""

# Llama-3-style: bos_token as a variable, strftime_now, tojson with indent, loop.last, raise_exception
LLAMA3_STYLE_TEMPLATE = """{{- bos_token }}
{%- set date_string = strftime_now("%d %b %Y") %}
{{- '<|im_start|>system\\nToday Date: ' + date_string + '\\n' }}
{%- if tools is not none %}
    {%- for t in tools %}{{- t | tojson(indent=4) }}{{- '\\n\\n' }}{%- endfor %}
{%- endif %}
{{- '<|im_end|>\\n' }}
{%- for message in messages %}
    {%- if (message.role == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}
    {%- endif %}
    {{- '<|im_start|>' + message.role + '\\n' + message.content | trim + '<|im_end|>\\n' }}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"""


# `import nanoserve.tokenizer` must not import transformers. The check runs in a fresh interpreter, started
# when this file is collected so that its few seconds of imports overlap with the other tests.
IMPORT_CHECK = subprocess.Popen(
    [sys.executable, "-c", "import sys, nanoserve.tokenizer as t; t.load_tokenizer().apply_chat_template("
                           "[{'role': 'user', 'content': 'hi'}]); print('transformers' in sys.modules)"],
    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@lru_cache(maxsize=None)
def smol():
    return load_tokenizer()


@lru_cache(maxsize=None)
def auto(path):
    quiet_transformers()
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(path)


@lru_cache(maxsize=None)
def small_tokenizer_json() -> str:
    "The default tokenizer.json cut to its first 1000 ids and no merges: it loads in milliseconds, not 0.3 s."
    spec = json.loads((default_model_dir() / "tokenizer.json").read_text())
    spec["model"]["vocab"] = {t: i for t, i in spec["model"]["vocab"].items() if i < 1000}
    spec["model"]["merges"] = []
    return json.dumps(spec)


def copy_tokenizer(dst: Path, small: bool = False, **config_changes) -> Path:
    "The default model's tokenizer files (no weights) in `dst`, with tokenizer_config.json entries changed (None deletes)."
    src = default_model_dir()
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "tokenizer.json", "generation_config.json"): shutil.copy(src / name, dst / name)
    if small: (dst / "tokenizer.json").write_text(small_tokenizer_json())  # for tests that compare no encodings
    config = json.loads((src / "tokenizer_config.json").read_text())
    for k, v in config_changes.items():
        if v is None: config.pop(k, None)
        else: config[k] = v
    (dst / "tokenizer_config.json").write_text(json.dumps(config))
    return dst


def ref_chat(ref, messages, gen=True, tokenize=False, **kw):
    return ref.apply_chat_template(messages, add_generation_prompt=gen, tokenize=tokenize,
                                   **({"return_dict": False} if tokenize else {}), **kw)


def assert_matches_transformers(ours: Tokenizer, ref, chats, **kw):
    for text in TEXTS:
        assert ours.encode(text) == ref(text).input_ids, text
        assert ours.encode(text, add_special_tokens=False) == ref(text, add_special_tokens=False).input_ids, text
        ids = ref(text).input_ids
        for skip in (False, True):
            assert ours.decode(ids, skip_special_tokens=skip) == ref.decode(ids, skip_special_tokens=skip), text
    for messages in chats:
        for gen in (True, False):
            assert ours.apply_chat_template(messages, gen, **kw) == ref_chat(ref, messages, gen, **kw)
            assert ours.apply_chat_template(messages, gen, tokenize=True, **kw) == ref_chat(ref, messages, gen, True, **kw)
    assert (ours.bos_token_id, ours.eos_token_id, ours.vocab_size) == (ref.bos_token_id, ref.eos_token_id, len(ref))
    assert ours.all_special_ids == ref.all_special_ids


# --- equality with transformers ---------------------------------------------------------------------------

def test_default_model_matches_autotokenizer():
    assert_matches_transformers(smol(), auto(default_model_dir()), CHATS)


def test_matches_transformers_reading_of_the_gguf():
    # transformers' reading stores the template in chat_template.jinja and builds its own tokenizer.json
    path = hf_default_model_dir()
    assert (path / "chat_template.jinja").exists()
    ours = load_tokenizer(path)
    assert_matches_transformers(ours, auto(path), CHATS)
    assert ours.apply_chat_template(CHATS[1]) == smol().apply_chat_template(CHATS[1])


def test_attributes_of_the_default_model():
    tok = smol()
    assert (tok.bos_token_id, tok.eos_token_id, tok.vocab_size) == (1, 2, 49152)
    assert tok.stop_token_ids == frozenset({2}) and isinstance(tok.stop_token_ids, frozenset)
    assert tok.encode("Hello") == [19556]  # SmolLM2 adds no BOS token
    prompt = tok.apply_chat_template(CHATS[0])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")


def test_qwen3_style_template_matches_autotokenizer(tmp_path):
    path = copy_tokenizer(tmp_path, chat_template=QWEN3_STYLE_TEMPLATE)
    ours, ref = load_tokenizer(path), auto(path)
    assert ours.chat_template == QWEN3_STYLE_TEMPLATE
    reasoning = [*CHATS[1][:3], {"role": "assistant", "content": "<think>\nhmm\n</think>\n\nTokyo."}]
    assert_matches_transformers(ours, ref, CHATS + [TOOL_CHAT, reasoning])
    for kw in ({"tools": [WEATHER]}, {"enable_thinking": False}):
        assert_matches_transformers(ours, ref, [CHATS[1], TOOL_CHAT], **kw)
    text = ours.apply_chat_template(TOOL_CHAT, tools=[WEATHER])
    assert '"Météo d\'une ville <ville>"' in text  # tojson: unicode and < > kept, as transformers renders it
    assert text.endswith("<|im_start|>assistant\n")
    assert ours.apply_chat_template(CHATS[0], enable_thinking=False).endswith("<think>\n\n</think>\n\n")


def test_chat_template_jinja_file_wins_over_the_config(tmp_path):
    # newer checkpoints ship chat_template.jinja; transformers then ignores the config's template
    path = copy_tokenizer(tmp_path, small=True)  # its tokenizer_config.json keeps SmolLM2's template
    (path / "chat_template.jinja").write_text(QWEN3_STYLE_TEMPLATE)
    tok = load_tokenizer(path)
    assert tok.chat_template == QWEN3_STYLE_TEMPLATE
    assert "SmolLM" not in tok.apply_chat_template(CHATS[0])  # SmolLM2's default system prompt is gone


def test_multi_template_config_uses_default(tmp_path):
    templates = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": QWEN3_STYLE_TEMPLATE}]
    assert load_tokenizer(copy_tokenizer(tmp_path, small=True, chat_template=templates)).chat_template == QWEN3_STYLE_TEMPLATE


def test_llama3_style_template_with_bos_date_and_indented_json(tmp_path):
    path = copy_tokenizer(tmp_path, chat_template=LLAMA3_STYLE_TEMPLATE)
    ours, ref = load_tokenizer(path), auto(path)
    chat = [{"role": "user", "content": "  Hi 🙂 "}, {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Bye"}]
    for kw in ({}, {"tools": [WEATHER]}):
        assert ours.apply_chat_template(chat, **kw) == ref_chat(ref, chat, **kw)
        assert ours.apply_chat_template(chat, tokenize=True, **kw) == ref_chat(ref, chat, tokenize=True, **kw)
    text = ours.apply_chat_template(chat, tools=[WEATHER])
    assert text.startswith("<|im_start|><|im_start|>system\nToday Date: ")  # bos_token variable, then the date
    assert '\n    "type": "function"' in text  # tojson(indent=4)
    ids = ours.apply_chat_template(chat, tokenize=True)
    assert ids[:2] == [1, 1]  # the template's BOS plus the system turn's <|im_start|>: encode added nothing
    with pytest.raises(ValueError, match="roles must alternate"):
        ours.apply_chat_template(chat[:1] * 2)
    with pytest.raises(Exception, match="roles must alternate"):  # transformers rejects it too
        ref_chat(ref, chat[:1] * 2)


BOS_POST_PROCESSOR = {"type": "TemplateProcessing",
                      "single": [{"SpecialToken": {"id": "<|im_start|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
                      "pair": [{"Sequence": {"id": "A", "type_id": 0}}, {"Sequence": {"id": "B", "type_id": 1}}],
                      "special_tokens": {"<|im_start|>": {"id": "<|im_start|>", "ids": [1], "tokens": ["<|im_start|>"]}}}


def test_bos_from_tokenizer_json_post_processor(tmp_path):
    # tokenizer.json's post-processor decides; transformers 5 ignores add_bos_token when tokenizer.json exists
    path = copy_tokenizer(tmp_path, add_bos_token=False, chat_template=LLAMA3_STYLE_TEMPLATE)
    spec = json.loads((path / "tokenizer.json").read_text())
    (path / "tokenizer.json").write_text(json.dumps({**spec, "post_processor": BOS_POST_PROCESSOR}))
    ours, ref = load_tokenizer(path), auto(path)
    assert ours.encode("Hello") == ref("Hello").input_ids == [1, 19556]
    assert ours.encode("Hello", add_special_tokens=False) == [19556]
    # the template writes bos_token itself; the prompt is not given a second one, as in transformers
    ids = ours.apply_chat_template(CHATS[0], tokenize=True)
    assert ids == ref_chat(ref, CHATS[0], tokenize=True) and ids[:3] == [1, 1, 9690]


def test_add_bos_token_builds_a_missing_post_processor(tmp_path):
    # a tokenizer.json without post-processor (our GGUF conversion) takes the flags from tokenizer_config.json
    tok = load_tokenizer(copy_tokenizer(tmp_path, add_bos_token=True, add_eos_token=True))
    assert tok.backend.post_processor is not None
    assert tok.encode("Hello") == [1, 19556, 2]
    assert tok.encode("Hello", add_special_tokens=False) == [19556]
    assert tok.apply_chat_template(CHATS[0], tokenize=True)[:2] == [1, 9690]  # <|im_start|>system, no extra BOS
    assert smol().backend.post_processor is None and smol().encode("Hello") == [19556]  # add_bos_token false


def test_stop_token_ids_from_generation_config(tmp_path):
    path = copy_tokenizer(tmp_path, small=True)
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [0, 5]}))
    assert load_tokenizer(path).stop_token_ids == frozenset({0, 2, 5})
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert load_tokenizer(path).stop_token_ids == frozenset({2, 7})
    (path / "generation_config.json").unlink()  # then config.json supplies it
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 3}))
    assert load_tokenizer(path).stop_token_ids == frozenset({2, 3})


def test_special_tokens_stored_as_added_token_dicts(tmp_path):
    path = copy_tokenizer(tmp_path, small=True, eos_token={"__type": "AddedToken", "content": "<|endoftext|>", "special": True},
                          additional_special_tokens=["<file_sep>"])
    tok = load_tokenizer(path)
    assert tok.eos_token_id == 0 and tok.stop_token_ids == frozenset({0, 2})
    # transformers' order: the named tokens (bos, eos, unk, sep, pad, cls, mask) without repeats, then the extras
    assert tok.all_special_ids == [1, 0, 2, 5]


def test_decode_accepts_tensors():
    import torch
    ids = smol().encode("The capital of France is Paris.")
    assert smol().decode(torch.tensor(ids)) == "The capital of France is Paris."
    for bad in ([-1], [2**40], [1.5]):  # once the Rust side's OverflowError or TypeError
        with pytest.raises(ValueError, match="expected token ids, integers >= 0"): smol().decode(bad)


def test_import_does_not_import_transformers():
    out, err = IMPORT_CHECK.communicate(timeout=120)
    assert IMPORT_CHECK.returncode == 0, err
    assert out.strip() == "False"


# --- errors ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("messages", [None, "hello", [], [["user", "hi"]], ["hi"], [{"content": "hi"}],
                                      [{"role": "user"}], [{"role": 3, "content": "hi"}], [{"role": "user", "content": 3}],
                                      [{"role": "user", "text": "hi"}], {"role": "user", "content": "hi"}])
def test_bad_messages_raise_value_error(messages):
    with pytest.raises(ValueError, match="messages"):
        smol().apply_chat_template(messages)


def test_assistant_tool_call_without_content_is_allowed():
    tok = Tokenizer(smol().backend, {}, QWEN3_STYLE_TEMPLATE)
    assert "<tool_call>" in tok.apply_chat_template(TOOL_CHAT)


def test_model_without_chat_template(tmp_path):
    tok = load_tokenizer(copy_tokenizer(tmp_path, small=True, chat_template=None))
    assert tok.chat_template is None
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template(CHATS[0])
    assert tok.decode(tok.encode("Hello")) == "Hello"  # the rest still works


def test_template_errors_become_value_errors():
    for template, match in [("{{ messages.append(1) }}", "SecurityError"),  # the sandbox: inputs are immutable
                            ("{{ ''.__class__.__mro__ }}", "SecurityError"),
                            ("{% for m in messages %}", "TemplateSyntaxError"),
                            ("{{ raise_exception('no system role') }}", "no system role")]:
        tok = Tokenizer(smol().backend, {}, template)
        with pytest.raises(ValueError, match=match):
            tok.apply_chat_template(CHATS[0])
    with pytest.raises(ValueError, match="could not render.*TypeError"):  # content parts, which SmolLM2's template adds to a str
        smol().apply_chat_template([{"role": "user", "content": [{"type": "text", "text": "hi"}]}])


def test_content_text_joins_text_parts_as_vllm_and_names_the_others():
    "The one flattening LLM.chat and the server share: text parts joined with newlines, other parts refused by type."
    from nanoserve.tokenizer import content_text
    assert content_text([{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]) == "a\nb"
    assert content_text("a") == "a" and content_text(None) is None and content_text([]) == ""
    for bad, match in [([{"type": "image_url", "image_url": {}}, {"type": "input_audio"}], "type 'image_url', 'input_audio'"),
                       (["a"], "type 'str'"), ([{"type": "text", "text": 5}], "type 'text'"), (5, "content=5: expected a string")]:
        with pytest.raises(ValueError, match=match): content_text(bad)


def test_missing_tokenizer_json(tmp_path):
    copy_tokenizer(tmp_path, small=True)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="tokenizer.json"):
        load_tokenizer(tmp_path)


def test_corrupt_tokenizer_files_are_value_errors_naming_the_file(tmp_path):
    copy_tokenizer(tmp_path, small=True)
    (tmp_path / "tokenizer_config.json").write_text('{"bos_token": ')
    with pytest.raises(ValueError, match="tokenizer_config.json is not valid JSON"): load_tokenizer(tmp_path)
    copy_tokenizer(tmp_path, small=True)
    (tmp_path / "tokenizer.json").write_text('{"model": ')
    with pytest.raises(ValueError, match="tokenizer.json could not be read"): load_tokenizer(tmp_path)


@pytest.mark.parametrize("text", ["The capital of France is Paris.", "<|im_start|>user\nhi<|im_end|>", " leading", "",
                                  "naïve café 東京 🙂", "a" * 5000])
def test_encode_equals_the_rust_tokenizers_encode(text):
    "encode goes through encode_batch (which lets go of the GIL); the ids are encode's, with and without special tokens."
    for special in (True, False):
        assert smol().encode(text, add_special_tokens=special) == smol().backend.encode(text, add_special_tokens=special).ids


def test_encode_rejects_non_strings():
    with pytest.raises(ValueError, match="text"):
        smol().encode([1, 2, 3])
    with pytest.raises(ValueError, match=r"lone surrogate, '\\ud800' at character 2"):  # UTF-8 cannot encode it
        smol().encode("ab\ud800c")


# --- incremental detokenization ----------------------------------------------------------------------------

def stream(tok, ids, skip=True, detok_cls=IncrementalDetokenizer, prompt_ids=()):
    "The detokenizer's pieces for `ids`, plus its flush; asserts that every partial text is a prefix of the final."
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=skip)
    full = tok.decode([*prompt_ids, *ids], skip_special_tokens=skip)[len(prompt_text):]  # what the ids add to the prompt
    sent, d = "", detok_cls(tok, skip, prompt_ids=prompt_ids)
    pieces = []
    for i in ids:
        pieces.append(d.step(i))
        sent += pieces[-1]
        assert full.startswith(sent), (ids, sent, full)
    pieces.append(d.flush())
    return pieces


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.integers(0, 49151), max_size=40), st.booleans())
def test_detokenizer_pieces_add_up_on_random_ids(ids, skip):
    tok = smol()
    assert "".join(stream(tok, ids, skip)) == tok.decode(ids, skip_special_tokens=skip)


@settings(max_examples=150, deadline=None)
@given(st.text(max_size=60), st.booleans())
def test_detokenizer_pieces_add_up_on_real_text(text, skip):
    tok = smol()
    ids = tok.encode(text)
    pieces = stream(tok, ids, skip)
    assert "".join(pieces) == tok.decode(ids, skip_special_tokens=skip)
    if "\ufffd" not in tok.decode(ids):  # (not always text: bytes missing from the vocabulary are dropped)
        assert not any("\ufffd" in p for p in pieces)  # never half a character


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=30), st.lists(st.integers(0, 49151), min_size=1, max_size=20))
def test_detokenizer_with_prompt_context(prompt, generated):
    tok = smol()
    prompt_ids = tok.encode(prompt)
    pieces = stream(tok, generated, prompt_ids=prompt_ids)
    # what the generated ids add to the prompt's text; for byte-level BPE that is their own decode
    prompt_text = tok.decode(prompt_ids, skip_special_tokens=True)
    assert "".join(pieces) == tok.decode(prompt_ids + generated, skip_special_tokens=True)[len(prompt_text):]
    assert "".join(pieces) == tok.decode(generated, skip_special_tokens=True)


def test_emoji_and_cjk_come_out_whole():
    tok = smol()
    ids = tok.encode("日本 👍🏽 ok")
    pieces = stream(tok, ids)
    assert [p for p in pieces if p] == ["日", "本", " 👍", "🏽", " ok"]
    assert len(ids) > len([p for p in pieces if p])  # some tokens were held back


def test_special_tokens_in_the_stream():
    tok = smol()
    ids = tok.apply_chat_template(CHATS[0], tokenize=True) + tok.encode("Paris.") + [2]
    assert "".join(stream(tok, ids, skip=False)).endswith("<|im_start|>assistant\nParis.<|im_end|>")
    assert "".join(stream(tok, ids, skip=True)).endswith("assistant\nParis.")
    assert stream(tok, [2], skip=True) == ["", ""]


def test_window_stays_short():
    tok = smol()
    d = IncrementalDetokenizer(tok)
    for i in tok.encode(" ".join(["The quick brown fox, 日本語, 🙂."] * 300)):
        d.step(i)
        assert len(d.ids) <= 8  # constant work per step, whatever the length of the stream


def test_flush_is_idempotent_and_the_stream_continues():
    tok = smol()
    d = IncrementalDetokenizer(tok)
    ids = tok.encode("👍 ok")
    assert d.step(ids[0]) == "" and d.flush() == tok.decode(ids[:1]) and d.flush() == ""
    assert d.step(tok.encode(" ok")[0]) == " ok"


def test_sentencepiece_style_spaces_need_context():
    sp = tokenizers.Tokenizer(tokenizers.models.WordLevel({"▁Hello": 0, "▁world": 1, "!": 2}, unk_token="!"))
    sp.decoder = tokenizers.decoders.Metaspace()
    tok = Tokenizer(sp)
    assert "".join(stream(tok, [0, 1, 2])) == "Hello world!"
    assert stream(tok, [1, 2], prompt_ids=[0])[:2] == [" world", "!"]
    # the trap: one token at a time loses the spaces
    assert "".join(tok.decode([i]) for i in [0, 1, 2]) == "Helloworld!"


def test_trap_detokenizer_without_hold_back_fails():
    class NoHoldBack(IncrementalDetokenizer):
        def _new_text(self):
            prefix, full = self._decode(self.ids[:self.read_offset]), self._decode(self.ids)
            return full[len(prefix):]
    tok = smol()
    ids = tok.encode("日本 👍🏽")
    with pytest.raises(AssertionError):
        stream(tok, ids, detok_cls=NoHoldBack)
    assert "".join(tok.decode([i]) for i in ids) != tok.decode(ids)  # and so does decoding one token at a time


def test_trap_plain_jinja_renders_differently(tmp_path):
    # the environment matters: jinja's defaults keep the newlines after block tags and HTML-escape tojson
    import jinja2
    template = "{% for m in messages %}\n    {% if m.role == 'user' %}\n{{ m.role }}: {{ m | tojson }}\n    {% endif %}\n{% endfor %}"
    path = copy_tokenizer(tmp_path, chat_template=template)
    ours, ref = load_tokenizer(path), auto(path)
    messages = [{"role": "user", "content": "<b>Zürich</b>"}]
    assert ours.apply_chat_template(messages) == ref_chat(ref, messages) == 'user: {"role": "user", "content": "<b>Zürich</b>"}\n'
    assert jinja2.Environment().from_string(template).render(messages=messages) != ours.apply_chat_template(messages)


def test_token_bytes_are_what_each_token_stands_for_also_inside_a_character():
    tok = load_tokenizer()
    text = "Emoji party: \U0001f389\U0001f389, \u4e2d\u6587, caf\u00e9 <|im_start|>"
    ids = tok.encode(text, add_special_tokens=False)
    assert any("\ufffd" in tok.decode([i]) for i in ids)  # some tokens hold part of a character
    assert b"".join(map(tok.token_bytes, ids)) == text.encode()
    for i in range(tok.vocab_size):  # every token that is whole characters: its bytes are its text's
        if "\ufffd" not in (s := tok.decode([i])): assert tok.token_bytes(i) == s.encode(), i
    with pytest.raises(ValueError, match="not in this tokenizer's vocabulary"): tok.token_bytes(tok.vocab_size)
    backend = tokenizers.Tokenizer.from_str(tok.backend.to_str())
    backend.add_tokens(["\u00e9t\u00e9"])  # an added token is stored as its text, not in the byte alphabet
    added = Tokenizer(backend)
    assert added.token_bytes(added.token_to_id("\u00e9t\u00e9")) == "\u00e9t\u00e9".encode()


def test_token_bytes_of_sentencepiece_byte_fallback_tokens():
    backend = tokenizers.Tokenizer(tokenizers.models.BPE({"<0xF0>": 0, "<0x9F>": 1, "\u2581hi": 2}, [], byte_fallback=True))
    backend.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
                                                    tokenizers.decoders.Fuse()])
    tok = Tokenizer(backend)
    assert [tok.token_bytes(i) for i in range(3)] == [b"\xf0", b"\x9f", b" hi"]


@pytest.mark.parametrize("decoder", [tokenizers.decoders.Metaspace(),  # and Llama 2's and Mistral's, which strips a leading space
                                     tokenizers.decoders.Sequence([tokenizers.decoders.Replace("\u2581", " "), tokenizers.decoders.ByteFallback(),
                                                                   tokenizers.decoders.Fuse(), tokenizers.decoders.Strip(" ", 1, 0)])])
def test_token_bytes_keep_the_space_a_sentencepiece_decoder_strips_from_a_lone_token(decoder):
    from nanoserve.protocol import token_text
    sp = tokenizers.Tokenizer(tokenizers.models.WordLevel({"\u2581Paris": 0, "\u2581is": 1, "!": 2}, unk_token="!"))
    sp.decoder = decoder
    tok = Tokenizer(sp)
    assert tok.space_marker == "\u2581" and tok.decode([1]) == "is"  # the trap: decoded alone, the space is gone
    assert [tok.token_bytes(i) for i in range(3)] == [b" Paris", b" is", b"!"]
    assert [token_text(tok, i) for i in range(3)] == [" Paris", " is", "!"]  # the names in log probabilities
    assert "".join(token_text(tok, i) for i in [1, 2]) == tok.decode([0, 1, 2])[len(tok.decode([0])):]  # they add up to the text
