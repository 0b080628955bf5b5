"""Chapter 12c: the OpenAI-compatible server on loopback, called through OpenAI's own client (sync and async) and raw
HTTP: results equal LLM.generate's, streams, 100+ concurrent streams, client disconnects, an engine fault, every error
status, a schema-driven fuzz that must find no 5xx, and SIGTERM on a `nanoserve serve` process."""
import asyncio, json, logging, os, re, shutil, signal, socket, subprocess, sys, threading, time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from nanoserve import LLM, SamplingParams
from nanoserve.loader import DEFAULT_MODEL, resolve_model
from nanoserve.server import TEXT_MARGIN, make_server, run_in_thread
from nanoserve.testing import save_tiny_model

MODEL = DEFAULT_MODEL
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, a robot", "1, 2, 3, 4,"]
CHAT = [{"role": "user", "content": "What is the capital of France?"}]
MAX_MODEL_LEN = 512


# --- servers and helpers ---------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def served():
    "The default model on the CPU, served from a thread of this process: (base URL, its AsyncLLMEngine)."
    server = make_server(port=0, max_model_len=MAX_MODEL_LEN, num_kv_blocks=400, device="cpu", log_level="warning")
    with run_in_thread(server) as url:
        yield url, server.config.app.state.server.engine


@pytest.fixture(scope="module")
def url(served): return served[0]


@pytest.fixture(scope="module")
def client(url): return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def reference():
    "LLM.generate's greedy outputs for PROMPTS and for CHAT (rendered with the chat template)."
    llm = LLM(max_model_len=MAX_MODEL_LEN, num_kv_blocks=128, device="cpu")
    greedy = SamplingParams(temperature=0, max_tokens=16)
    chat_ids = llm.get_tokenizer().apply_chat_template(CHAT, tokenize=True)
    outs = llm.generate([*PROMPTS, chat_ids], greedy, use_tqdm=False)
    return {"prompts": outs[:-1], "chat": outs[-1], "llm": llm}


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory):
    "A tiny random llama with the default model's vocabulary and tokenizer (chat template included): fast to serve."
    path = save_tiny_model("llama", tmp_path_factory.mktemp("tiny-chat"), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"): shutil.copy(resolve_model(None) / name, path / name)
    return path


def metric(url: str, name: str, **labels) -> float:
    "The sum of the samples called `name` (with these labels) in the server's /metrics."
    families = text_string_to_metric_families(httpx.get(f"{url}/metrics").text)
    return sum(s.value for f in families for s in f.samples
               if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()))


def wait_until_idle(url: str, timeout: float = 10.0) -> dict:
    "Poll /metrics until nothing runs or waits and the KV cache is empty; the last readings."
    deadline = time.monotonic() + timeout
    while True:
        now = {n: metric(url, f"nanoserve:{n}") for n in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc")}
        if not any(now.values()) or time.monotonic() > deadline: return now
        time.sleep(0.05)


class ServeProcess:
    """`nanoserve serve` in a child process on a port the OS picks (`--port 0`), so no other test can take the port
    between a check and the bind. Its output is collected by a thread: `base` waits for the URL it logs, `output`
    returns everything once the process has ended."""
    def __init__(self, *args: str):
        self.proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", "0", "--device", "cpu", *args],
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines, self._found = [], threading.Event()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line)
            if re.search(r"at http://\S+/v1 ", line): self._found.set()
        self._found.set()  # the output ended: base() reports it

    def base(self, timeout: float = 120) -> str:
        "http://host:port once the server listens and answers /health."
        assert self._found.wait(timeout), "no start"
        [url] = [m[1] for line in self.lines if (m := re.search(r"at (http://\S+)/v1 ", line))] or ["".join(self.lines)]
        assert url.startswith("http://"), url  # the process ended without serving: its output
        deadline = time.monotonic() + timeout
        while True:
            try:
                if httpx.get(f"{url}/health").status_code == 200: return url
            except httpx.HTTPError: pass
            assert self.proc.poll() is None and time.monotonic() < deadline, "".join(self.lines)
            time.sleep(0.1)

    def output(self) -> str:
        "Everything the process wrote; kills it first if it still runs."
        if self.proc.poll() is None: self.proc.kill()
        self.proc.wait()
        self._reader.join(timeout=10)
        return "".join(self.lines)


# --- the openai client: results equal LLM.generate's ---------------------------------------------------------------

def test_models_and_health(url, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError, match="gpt-5"): client.models.retrieve("gpt-5")
    assert httpx.get(f"{url}/health").status_code == 200 and httpx.head(f"{url}/health").status_code == 200
    from nanoserve import __version__
    assert httpx.get(f"{url}/version").json() == {"version": __version__}
    assert "/v1/chat/completions" in httpx.get(f"{url}/openapi.json").json()["paths"]


def test_a_kv_cache_shorter_than_the_context_is_logged_and_the_model_card_says_what_fits(tiny_chat_model, caplog):
    with caplog.at_level(logging.WARNING, logger="nanoserve.server"):
        server = make_server(str(tiny_chat_model), port=0, max_model_len=512, num_kv_blocks=8, device="cpu", log_level="warning")
    assert "the KV cache holds 128 tokens, fewer than max_model_len=512" in caplog.text
    with run_in_thread(server) as url:
        assert httpx.get(f"{url}/v1/models").json()["data"][0]["max_model_len"] == 128


def test_completions_equal_llm_generate(client, reference):
    for prompt, ref in zip(PROMPTS, reference["prompts"]):
        r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)
        assert r.choices[0].text == ref.text
        assert r.choices[0].finish_reason == ref.finish_reason
        assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
        assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens



def test_usage_and_metrics_report_the_prefix_cache(client, url):
    "A repeated prompt finds its full blocks in the prefix cache: usage says how many tokens, and /metrics counts them."
    messages = [{"role": "system", "content": "You answer in one word. " * 8}, {"role": "user", "content": "Sky colour?"}]
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    wait_until_idle(url)
    before = {n: metric(url, f"nanoserve:{n}") for n in ("prefix_cache_queries_total", "prefix_cache_hits_total")}
    again = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    wait_until_idle(url)
    n = again.usage.prompt_tokens
    assert again.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0  # whole blocks, the last token computed
    assert first.usage.prompt_tokens_details.cached_tokens <= again.usage.prompt_tokens_details.cached_tokens
    assert metric(url, "nanoserve:prefix_cache_queries_total") - before["prefix_cache_queries_total"] == n
    assert metric(url, "nanoserve:prefix_cache_hits_total") - before["prefix_cache_hits_total"] == (n - 1) // 16 * 16
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, stream=True,
                                         stream_options={"include_usage": True})
    assert [c.usage for c in streamed][-1].prompt_tokens_details.cached_tokens % 16 == 0


def test_metrics_count_tokens_and_latencies(client, url):
    "Every counter and histogram of /metrics moves by what one request did."
    names = ("prompt_tokens_total", "generation_tokens_total", "time_to_first_token_seconds_count",
             "time_per_output_token_seconds_count", "e2e_request_latency_seconds_count", "e2e_request_latency_seconds_sum",
             "request_prompt_tokens_sum", "request_generation_tokens_sum", "num_preemptions_total")
    wait_until_idle(url)
    before = {n: metric(url, f"nanoserve:{n}") for n in names}
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=5, temperature=0, extra_body={"ignore_eos": True})
    wait_until_idle(url)
    moved = {n: metric(url, f"nanoserve:{n}") - before[n] for n in names}
    assert moved["prompt_tokens_total"] == moved["request_prompt_tokens_sum"] == r.usage.prompt_tokens
    assert moved["generation_tokens_total"] == moved["request_generation_tokens_sum"] == r.usage.completion_tokens == 5
    assert moved["time_to_first_token_seconds_count"] == moved["time_per_output_token_seconds_count"] == 1
    assert moved["e2e_request_latency_seconds_count"] == 1 and moved["e2e_request_latency_seconds_sum"] > 0
    assert moved["num_preemptions_total"] == 0

def test_completion_of_token_ids(client, reference):
    ref = reference["prompts"][0]
    r = client.completions.create(model=MODEL, prompt=ref.prompt_token_ids, max_tokens=16, temperature=0)
    assert r.choices[0].text == ref.text


def test_chat_equals_llm_generate_plain_and_streamed(client, reference):
    ref = reference["chat"]
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0)
    assert r.choices[0].message.content == ref.text and r.choices[0].message.role == "assistant"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ref.prompt_token_ids), len(ref.token_ids))
    parts = list(client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0,
                                                stream=True, stream_options={"include_usage": True}))
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts if p.choices) == ref.text
    with_choices = [p for p in parts if p.choices]
    assert with_choices[-1].choices[0].finish_reason == ref.finish_reason
    assert all(p.choices[0].finish_reason is None for p in with_choices[:-1])
    assert not parts[-1].choices and parts[-1].usage.completion_tokens == len(ref.token_ids)
    assert parts[-1].usage.prompt_tokens == len(ref.prompt_token_ids)


def stream_chunks(url: str, path: str, body: dict) -> list:
    "The JSON chunks of a streamed request."
    with httpx.stream("POST", f"{url}{path}", json={"model": MODEL, "stream": True, **body}, timeout=120) as r:
        return [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]


def test_stream_options_give_usage_by_default_and_in_every_chunk_if_asked(url):
    "vLLM's StreamOptions: include_usage defaults to true; continuous_usage_stats puts each choice's counts so far in every chunk."
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "n": 2, "temperature": 1.0, "seed": 1, "logprobs": 0, "ignore_eos": True}
    last = stream_chunks(url, C, {**body, "stream_options": {}})
    assert last[-1]["choices"] == [] and last[-1]["usage"]["completion_tokens"] == 8
    assert all(chunk["usage"] is None for chunk in last[:-1])
    assert all(c["usage"] is None for c in stream_chunks(url, C, {**body, "stream_options": {"include_usage": False,
                                                                                               "continuous_usage_stats": True}}))
    chunks = stream_chunks(url, C, {**body, "stream_options": {"continuous_usage_stats": True}})
    prompt_tokens, seen = chunks[-1]["usage"]["prompt_tokens"], [0, 0]
    for chunk in chunks[:-1]:
        [c] = chunk["choices"]
        seen[c["index"]] += len(c["logprobs"]["tokens"])
        assert chunk["usage"]["prompt_tokens"] == prompt_tokens and chunk["usage"]["completion_tokens"] == seen[c["index"]]
        assert chunk["usage"]["total_tokens"] == prompt_tokens + seen[c["index"]]
    assert seen == [4, 4]
    chat = stream_chunks(url, CHAT_PATH, {"messages": CHAT, "max_tokens": 3, "n": 2, "logprobs": True, "ignore_eos": True,
                                          "stream_options": {"continuous_usage_stats": True}})
    prompt_tokens, seen = chat[-1]["usage"]["prompt_tokens"], [0, 0]
    for chunk in chat[:-1]:
        [c] = chunk["choices"]
        seen[c["index"]] += len((c["logprobs"] or {"content": []})["content"])  # the role's chunk and the finish chunk: none
        assert (chunk["usage"]["prompt_tokens"], chunk["usage"]["completion_tokens"]) == (prompt_tokens, seen[c["index"]])
    assert seen == [3, 3] and chat[-1]["usage"]["completion_tokens"] == 6


def test_async_client_streams_concurrently(url, reference):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        async def complete(prompt):
            text = ""
            async for part in await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0, stream=True):
                text += part.choices[0].text if part.choices else ""
            return text
        async def chat():
            r = await aclient.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=16, temperature=0)
            return r.choices[0].message.content
        return await asyncio.gather(*map(complete, PROMPTS), chat())
    *texts, chat_text = asyncio.run(main())
    assert texts == [ref.text for ref in reference["prompts"]]
    assert chat_text == reference["chat"].text


def test_stop_strings(client, reference):
    ref = reference["prompts"][0].text
    stop = ref[len(ref) // 2: len(ref) // 2 + 3]
    expected = ref[:ref.index(stop)]
    r = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop, "never seen"])
    assert (r.choices[0].text, r.choices[0].finish_reason, r.choices[0].stop_reason) == (expected, "stop", stop)  # vLLM's stop_reason
    streamed = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop, stream=True)
    parts = list(streamed)
    assert "".join(p.choices[0].text for p in parts) == expected and parts[-1].choices[0].finish_reason == "stop"
    assert parts[-1].choices[0].stop_reason == stop and all(p.choices[0].stop_reason is None for p in parts[:-1])
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PROMPTS[0]}], max_tokens=16,
                                          temperature=0, stop=["e"])
    assert chat.choices[0].stop_reason == "e" and "e" not in chat.choices[0].message.content
    kept = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=stop,
                                     extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == expected + stop  # vLLM's include_stop_str_in_output
    raw = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "What is the capital of France?"}],
                                         max_tokens=24, temperature=0, extra_body={"ignore_eos": True, "skip_special_tokens": False})
    assert "<|im_end|>" in raw.choices[0].message.content  # vLLM's skip_special_tokens
    long = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=2, temperature=0)
    assert long.choices[0].finish_reason == "length" and long.choices[0].stop_reason is None


def test_seeds_are_reproducible(client):
    def sample(seed, stream=False):
        r = client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=16, temperature=1.0,
                                      seed=seed, stream=stream)
        return "".join(p.choices[0].text for p in r) if stream else r.choices[0].text
    a = sample(7)
    assert sample(7) == a and sample(7, stream=True) == a
    assert sample(8) != a


def test_n_choices_of_several_prompts_are_the_single_requests_with_seeds_seed_plus_j(client):
    "Choice i * n + j is prompt i sampled with seed + j; each prompt counts once in usage, every token counts."
    prompts, n, seed = PROMPTS[:2], 3, 11
    args = dict(model=MODEL, max_tokens=8, temperature=1.0)
    r = client.completions.create(prompt=prompts, n=n, seed=seed, **args)
    singles = [client.completions.create(prompt=p, seed=seed + j, **args) for p in prompts for j in range(n)]
    assert [c.index for c in r.choices] == list(range(len(prompts) * n))
    assert [(c.text, c.finish_reason) for c in r.choices] == [(s.choices[0].text, s.choices[0].finish_reason) for s in singles]
    assert len({c.text for c in r.choices[:n]}) > 1  # the samples of one prompt differ
    assert r.usage.prompt_tokens == sum(s.usage.prompt_tokens for s in singles[::n])
    assert r.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)
    streamed = list(client.completions.create(prompt=prompts, n=n, seed=seed, stream=True,
                                              stream_options={"include_usage": True}, **args))
    texts, finishes = [""] * len(r.choices), [[] for _ in r.choices]
    for part in streamed:
        for c in part.choices:
            texts[c.index] += c.text
            if c.finish_reason: finishes[c.index].append(c.finish_reason)
    assert texts == [c.text for c in r.choices] and finishes == [[c.finish_reason] for c in r.choices]
    assert streamed[-1].usage == r.usage


def test_n_chat_choices_plain_and_streamed(client):
    args = dict(model=MODEL, messages=CHAT, max_tokens=6, temperature=1.0, seed=3, n=2)
    r = client.chat.completions.create(**args)
    assert [c.index for c in r.choices] == [0, 1] and r.usage.completion_tokens == sum(
        client.chat.completions.create(**{**args, "n": 1, "seed": 3 + j}).usage.completion_tokens for j in range(2))
    parts = list(client.chat.completions.create(**args, stream=True))
    for i, choice in enumerate(r.choices):
        mine = [c for p in parts for c in p.choices if c.index == i]
        assert mine[0].delta.role == "assistant" and mine[-1].finish_reason == choice.finish_reason
        assert [c.finish_reason for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert "".join(c.delta.content or "" for c in mine) == choice.message.content


def test_a_refused_choice_leaves_none_of_its_request_queued(url):
    "One prompt of a list refused by the engine (a token id outside the vocabulary): a 400, and nothing of it runs."
    aborted = metric(url, "nanoserve:request_success_total", finished_reason="abort")
    r = httpx.post(f"{url}{C}", json={"model": MODEL, "prompt": [[1, 2, 3]] * 5 + [[1, 10**6]], "n": 4,
                                      "max_tokens": 300, "ignore_eos": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert wait_until_idle(url, timeout=2) == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}
    assert metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 20  # the 20 it took, aborted


def test_penalties_and_logit_bias_equal_llm_generate(client, reference):
    args = dict(presence_penalty=0.5, frequency_penalty=1.0, logit_bias={"28": 5.0, "1000": -100.0})
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=24, temperature=0, extra_body={"repetition_penalty": 1.3},
                                  **args)
    params = SamplingParams(temperature=0, max_tokens=24, repetition_penalty=1.3, **{**args, "logit_bias": {28: 5.0, 1000: -100.0}})
    ref = reference["llm"].generate([PROMPTS[2]], params, use_tqdm=False)[0]
    assert r.choices[0].text == ref.text and not r.choices[0].text.startswith(reference["prompts"][2].text)  # 16 greedy tokens
    forced = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, temperature=0.7, logit_bias={"28": 100}, logprobs=0)
    tok = reference["llm"].get_tokenizer()
    assert forced.choices[0].logprobs.tokens == [tok.decode([28])] * 3


def test_completion_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == r.usage.completion_tokens == 12
    assert "".join(lp.tokens) == r.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 3 and chosen <= 0
        assert chosen == pytest.approx(max(top.values()), abs=1e-5)  # greedy: the chosen token is the most likely
    streamed = list(client.completions.create(model=MODEL, prompt=PROMPTS[1], max_tokens=12, temperature=0, logprobs=3, stream=True))
    tokens = [t for p in streamed for t in p.choices[0].logprobs.tokens]
    assert tokens == lp.tokens


def test_completion_top_logprobs_always_hold_the_chosen_token(client):
    "OpenAI's rule, and vLLM's: the chosen token's log probability is always given, so up to logprobs + 1 entries."
    r = client.completions.create(model=MODEL, prompt=PROMPTS[2], max_tokens=12, temperature=2.0, seed=3, logprobs=1)
    lp = r.choices[0].logprobs
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert list(top)[0] == token and top[token] == chosen and len(top) <= 2
    assert any(len(top) == 2 for top in lp.top_logprobs)  # at temperature 2, some chosen tokens are not the most likely
    alone = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=3, echo=True, logprobs=0, temperature=0).choices[0].logprobs
    assert alone.top_logprobs[0] is None  # the prompt's first token has nothing before it
    assert alone.top_logprobs[1:] == [{t: v} for t, v in zip(alone.tokens[1:], alone.token_logprobs[1:])]


def test_echo_returns_the_prompt_scored_as_llm_prompt_logprobs(client, reference):
    "lm-evaluation-harness's request: the prompt alone (max_tokens 0) with its log probabilities, as LLM.generate gives them."
    prompt = PROMPTS[0] + " Paris."
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=0, echo=True, logprobs=1, temperature=0)
    ch, lp = r.choices[0], r.choices[0].logprobs
    want = reference["llm"].generate(prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1), use_tqdm=False)[0]
    assert ch.text == prompt and ch.finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(want.prompt_token_ids), 0)
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # the first token has nothing before it
    assert lp.token_logprobs[1:] == pytest.approx([e.logprob for e in want.prompt_logprobs[1:]], abs=1e-4)
    tok = reference["llm"].get_tokenizer()
    assert lp.tokens == [tok.decode([t]) for t in want.prompt_token_ids] and "".join(lp.tokens) == prompt
    assert [list(top) for top in lp.top_logprobs[1:]] == [list(dict.fromkeys([tok.decode([t]), tok.decode([e.top[0][0]])]))
                                                          for t, e in zip(want.prompt_token_ids[1:], want.prompt_logprobs[1:])]  # its own, then the best
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    more = client.completions.create(model=MODEL, prompt=prompt, max_tokens=3, echo=True, logprobs=1, temperature=0)
    generated = reference["llm"].generate(prompt, SamplingParams(temperature=0, max_tokens=3), use_tqdm=False)[0]
    assert more.choices[0].text == prompt + generated.text and more.usage.completion_tokens == 3
    assert len(more.choices[0].logprobs.tokens) == len(want.prompt_token_ids) + 3
    assert more.choices[0].logprobs.token_logprobs[:len(lp.tokens)] == pytest.approx(lp.token_logprobs, abs=1e-4)
    assert more.choices[0].logprobs.text_offset[len(lp.tokens)] == len(prompt)  # the completion starts after the prompt


def test_lm_evaluation_harness_reads_an_answers_log_likelihood_as_llm_generate_gives_it(url, reference):
    """lm-evaluation-harness's local-completions: token ids of context + answer, max_tokens 1, echo, logprobs 1; it sums
    token_logprobs[ctxlen:-1] (the last is the drawn token) and calls the answer greedy if each is its top_logprobs' best."""
    tok = reference["llm"].get_tokenizer()
    context, answers = tok.encode("The capital of France is"), [tok.encode(" Paris"), tok.encode(" a city of light")]
    body = {"model": MODEL, "prompt": [context + a for a in answers], "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    reply = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()
    scored = reference["llm"].generate([context + a for a in answers], SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=1),
                                       use_tqdm=False)
    for choice, answer, want in zip(sorted(reply["choices"], key=lambda c: c["index"]), answers, scored):
        lp, n = choice["logprobs"], len(context)
        assert len(lp["token_logprobs"]) == len(context) + len(answer) + 1
        assert sum(lp["token_logprobs"][n:-1]) == pytest.approx(sum(e.logprob for e in want.prompt_logprobs[n:]), abs=1e-4)
        greedy = all(v == max(top.values()) for v, top in zip(lp["token_logprobs"][n:-1], lp["top_logprobs"][n:-1]))
        assert greedy == all(e.token_id == e.top[0][0] for e in want.prompt_logprobs[n:])


def test_echo_streams_and_takes_token_ids_and_many_prompts(client, url, reference):
    prompt = PROMPTS[3]
    ids = reference["llm"].get_tokenizer().encode(prompt)
    whole = client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0)
    parts = list(client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, echo=True, logprobs=2, temperature=0, stream=True))
    assert "".join(p.choices[0].text for p in parts) == whole.choices[0].text
    assert parts[0].choices[0].text.startswith(prompt)  # the first chunk brings the prompt
    assert [t for p in parts for t in p.choices[0].logprobs.tokens] == whole.choices[0].logprobs.tokens
    assert [v for p in parts for v in p.choices[0].logprobs.token_logprobs] == pytest.approx(whole.choices[0].logprobs.token_logprobs, abs=1e-4)
    plain = client.completions.create(model=MODEL, prompt=[ids, ids[:2]], n=2, max_tokens=0, echo=True, temperature=0)
    texts = reference["llm"].get_tokenizer().decode(ids), reference["llm"].get_tokenizer().decode(ids[:2])
    assert [c.text for c in plain.choices] == [texts[0], texts[0], texts[1], texts[1]]  # prompt-major, no completion
    assert all(c.logprobs is None for c in plain.choices) and plain.usage.completion_tokens == 0
    assert plain.usage.prompt_tokens == len(ids) + 2
    zero = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 0}, timeout=60)
    assert zero.status_code == 400 and zero.json()["error"]["param"] == "max_tokens" and "echo" in zero.json()["error"]["message"]
    with httpx.stream("POST", f"{url}/v1/completions", timeout=60, json={"model": MODEL, "prompt": prompt, "max_tokens": 0,
                                                                         "echo": True, "stream": True}) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
    assert [e["choices"][0]["text"] for e in events] == [prompt] and events[0]["choices"][0]["finish_reason"] == "length"


def test_echo_of_token_ids_needs_a_tokenizer_and_room_for_the_drawn_token():
    from types import SimpleNamespace
    from nanoserve.protocol import CompletionRequest, InvalidRequest
    from nanoserve.server import OpenAIServer
    server = SimpleNamespace(tokenizer=None, longest_request=8)
    OpenAIServer.check_echo(server, CompletionRequest(prompt="hi", echo=True), [[1]])  # a string is echoed as it came
    with pytest.raises(InvalidRequest, match="no tokenizer, so echo cannot") as e:
        OpenAIServer.check_echo(server, CompletionRequest(prompt=[5, 6], echo=True), [[5, 6]])
    assert e.value.param == "echo"
    OpenAIServer.check_echo(server, CompletionRequest(prompt="x", echo=True, max_tokens=0), [[1] * 7])
    with pytest.raises(InvalidRequest, match="max_tokens 0 still needs one position after the prompt.*your prompt has 8 tokens") as e:
        OpenAIServer.check_echo(server, CompletionRequest(prompt="x", echo=True, max_tokens=0), [[1] * 8])
    assert e.value.param == "prompt"
    with pytest.raises(ValueError, match="max_tokens=0 with min_tokens=2"):
        CompletionRequest(prompt="x", echo=True, max_tokens=0, min_tokens=2)


def test_echo_offsets_give_a_bos_token_no_room_and_a_stream_the_same_offsets():
    "Llama 3's tokenizer puts a BOS token before every prompt, which the echoed text does not show."
    import asyncio
    from nanoserve.engine import PromptLogprobs, RequestMetrics, RequestOutput, TokenLogprobs
    from nanoserve.protocol import Echo, completion_response
    from nanoserve.server import completion_events
    from nanoserve.tokenizer import load_tokenizer
    tok = load_tokenizer()
    bos, text = tok.token_to_id("<|im_start|>"), "Hello world again"
    ids = [bos] + tok.encode(text)
    scored = PromptLogprobs(ids, 1)
    scored.fill(1, np.full(len(ids) - 1, -1.0, np.float32), np.array([[t] for t in ids[1:]]), np.full((len(ids) - 1, 1), -1.0, np.float32))
    gen = tok.encode(" and again")
    outs = [RequestOutput("r", text, ids, tok.decode(gen[:k]), gen[:k], k == len(gen), "length" if k == len(gen) else None,
                          RequestMetrics(0.0), [TokenLogprobs(t, -0.5, [(t, -0.5)]) for t in gen[:k]], prompt_logprobs=scored)
            for k in range(1, len(gen) + 1)]
    whole = completion_response("c", "m", [outs[-1]], tok, echo=Echo([text]))["choices"][0]
    lp = whole["logprobs"]
    assert whole["text"] == text + outs[-1].text and lp["text_offset"][:2] == [0, 0]  # the BOS token is no character wide
    for token, at in zip(lp["tokens"][1:], lp["text_offset"][1:]): assert whole["text"][at:].startswith(token)
    async def stream():
        async def outputs():
            for out in outs: yield out
        return [e async for e in completion_events([outputs()], "c", "m", tok, False, echo=Echo([text]))]
    chunks = [json.loads(e[6:]) for e in asyncio.run(stream()) if e.startswith("data: {")]
    offsets = [o for c in chunks for o in c["choices"][0]["logprobs"]["text_offset"]]
    assert offsets == lp["text_offset"] and "".join(c["choices"][0]["text"] for c in chunks) == whole["text"]


def test_tokenize_detokenize_and_tokenizer_info_as_vllm_serves_them(url, reference):
    "The endpoints lm-evaluation-harness's remote tokenizer uses: /tokenizer_info, then /tokenize and /detokenize."
    tok = reference["llm"].get_tokenizer()
    info = httpx.get(f"{url}/tokenizer_info").json()
    assert info["eos_token"] == "<|im_end|>" and info["chat_template"] == tok.chat_template and info["max_model_len"] == MAX_MODEL_LEN
    r = httpx.post(f"{url}/tokenize", json={"prompt": PROMPTS[0], "return_token_strs": True}).json()
    assert r["tokens"] == tok.encode(PROMPTS[0]) and r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    assert r["token_strs"] == ["The", "\u0120capital", "\u0120of", "\u0120France", "\u0120is"]  # byte-level BPE: \u0120 is a space
    eos = httpx.post(f"{url}/tokenize", json={"prompt": info["eos_token"], "add_special_tokens": False}).json()["tokens"]
    assert eos == [tok.token_to_id("<|im_end|>")]  # how lm-evaluation-harness finds the end-of-sequence id
    chat = httpx.post(f"{url}/tokenize", json={"messages": CHAT}).json()["tokens"]
    assert chat == tok.apply_chat_template(CHAT, tokenize=True) == reference["chat"].prompt_token_ids
    opened = httpx.post(f"{url}/tokenize", json={"messages": CHAT, "add_generation_prompt": False}).json()["tokens"]
    assert chat[:len(opened)] == opened and len(opened) < len(chat)
    assert httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": PROMPTS[0]}
    for path, body, param in (("/detokenize", {"tokens": [1, 49152]}, "tokens"), ("/detokenize", {"tokens": [-1]}, "tokens"),
                              ("/tokenize", {"prompt": "a", "messages": CHAT}, "messages"), ("/tokenize", {}, "messages"),
                              ("/tokenize", {"messages": CHAT, "continue_final_message": True}, "continue_final_message"),
                              ("/tokenize", {"prompt": "a", "model": "other"}, "model")):
        bad = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert bad.status_code in (400, 404, 413) and (param is None or bad.json()["error"]["param"] == param), (path, body, bad.text)
    assert "give a prompt or messages" in httpx.post(f"{url}/tokenize", json={}).json()["error"]["message"]  # neither


def test_tokenize_takes_long_documents_and_special_tokens_as_asked(url):
    "Counting a long document's tokens is what /tokenize is for: only the body limit bounds it (a completion refuses such text)."
    long = "All work and no play makes Jack a dull boy. " * 6000  # 264,000 characters: far more than 512 tokens
    r = httpx.post(f"{url}/tokenize", json={"prompt": long, "return_token_strs": None}, timeout=60)
    assert r.status_code == 200 and r.json()["count"] > 50_000 and r.json()["token_strs"] is None
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": long}, timeout=60).status_code == 400


def test_tokenize_adds_special_tokens_to_a_prompt_and_not_to_a_conversation():
    "vLLM's add_special_tokens: by default true for a prompt, false for a conversation; /tokenize, completions and chat alike."
    import asyncio
    from types import SimpleNamespace
    from nanoserve.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest
    from nanoserve.server import OpenAIServer
    class Tokenizer:  # records what it was asked
        chat_template = "{{ messages[0].content }}"
        def encode(self, text, add_special_tokens=True): return [int(add_special_tokens)]
        def apply_chat_template(self, messages, add_generation_prompt=True): return messages[0]["content"]
    server = SimpleNamespace(tokenizer=Tokenizer(), check_text=lambda text, param, which="": None, check_chars=lambda n, param, which="": None)
    server.chat_ids = lambda *a, **k: OpenAIServer.chat_ids(server, *a, **k)
    ask = lambda **body: asyncio.run(OpenAIServer.tokenize(server, TokenizeRequest(**body)))
    chat = [{"role": "user", "content": "hi"}]
    assert (ask(prompt="hi"), ask(prompt="hi", add_special_tokens=False), ask(messages=chat), ask(messages=chat, add_special_tokens=True)) == \
           ([1], [0], [0], [1])
    complete = lambda **body: asyncio.run(OpenAIServer.completion_prompts(server, CompletionRequest(prompt="hi", **body)))
    answer = lambda **body: asyncio.run(OpenAIServer.chat_prompt(server, ChatCompletionRequest(messages=chat, **body)))
    assert (complete(), complete(add_special_tokens=False), answer(), answer(add_special_tokens=True)) == ([[1]], [[0]], [0], [1])


def test_chat_logprobs(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_completion_tokens=8, temperature=0,
                                       logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 8
    spoken = content[:-1] if r.choices[0].finish_reason == "stop" else content  # a stop token has a logprob but no text
    assert "".join(c.token for c in spoken) == r.choices[0].message.content
    for c in content:
        assert len(c.top_logprobs) == 2 and c.top_logprobs[0].logprob >= c.top_logprobs[1].logprob
        assert c.bytes == list(c.token.encode()) and c.logprob == pytest.approx(c.top_logprobs[0].logprob, abs=1e-5)


def test_log_probabilities_name_partial_characters_by_their_bytes_and_count_offsets_in_characters():
    from nanoserve.engine import RequestMetrics, RequestOutput, TokenLogprobs
    from nanoserve.protocol import TextOffsets, chat_logprobs, completion_logprobs
    from nanoserve.tokenizer import load_tokenizer
    tok, text = load_tokenizer(), " \U0001f389\U0001f389 ok"
    ids = tok.encode(text, add_special_tokens=False)  # ' \xf0\x9f', '\x8e', '\x89', '\xf0\x9f', '\x8e', '\x89', ' ok'
    out = RequestOutput("r", None, [1], text, ids, True, "length", RequestMetrics(0.0),
                        [TokenLogprobs(i, -0.5, [(i, -0.5), (ids[-1], -1.5)]) for i in ids])
    whole = completion_logprobs(out, tok, 0, len(ids))
    assert whole["tokens"] == ["bytes: \\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89", "bytes:\\xf0\\x9f", "bytes:\\x8e", "bytes:\\x89", " ok"]
    assert whole["text_offset"] == [0, 1, 1, 2, 2, 2, 3]  # characters of the text: each emoji is one
    assert whole["top_logprobs"][1] == {"bytes:\\x8e": -0.5, " ok": -1.5}
    for cut in range(1, len(ids)):  # streamed in two chunks, with one TextOffsets; the second's text starts where the first's ends
        sent, offsets = len(tok.decode(ids[:cut]).rstrip("\ufffd")), TextOffsets(tok)  # sent: no partial character
        first = completion_logprobs(out, tok, 0, cut, offsets=offsets)
        second = completion_logprobs(out, tok, cut, len(ids), text_offset=sent, offsets=offsets)
        assert first["text_offset"] + second["text_offset"] == whole["text_offset"], cut
    content = chat_logprobs(out, tok, 0, len(ids))["content"]
    assert [c["token"] for c in content][:2] == [" \\xf0\\x9f", "\\x8e"]  # chat: no prefix, the bytes are in their own field
    assert bytes(b for c in content for b in c["bytes"]).decode() == text


def test_logprobs_of_tokens_that_hold_part_of_a_character(client, url):
    "An emoji spans several byte-level tokens: each is named by its bytes, so top_logprobs keep every alternative."
    r = client.completions.create(model=MODEL, prompt="Emoji party: \U0001f389\U0001f389", max_tokens=6, temperature=0, logprobs=5)
    text, lp = r.choices[0].text, r.choices[0].logprobs
    assert "\U0001f389" in text and any(t.startswith("bytes:") for t in lp.tokens)  # the model goes on with the emoji
    assert all(len(top) == 5 for top in lp.top_logprobs)  # none collide under one U+FFFD key
    for token, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(chosen, abs=1e-5)  # greedy: the chosen token is in its own top 5, by its name
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(text)
    content = httpx.post(f"{url}/v1/chat/completions", timeout=120, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Reply with only this emoji: \U0001f389"}],
        "max_tokens": 6, "temperature": 0, "logprobs": True, "top_logprobs": 2}).json()["choices"][0]
    assert bytes(b for c in content["logprobs"]["content"] for b in c["bytes"]).decode(errors="replace").startswith(
        content["message"]["content"])  # the bytes rebuild the text


@pytest.mark.parametrize("extra", [{}, {"echo": True, "n": 2}])
def test_streamed_text_offsets_equal_the_responses_when_a_token_ends_inside_a_character(url, extra):
    "The detokenizer holds back the text of a token that ends inside a character (here a space and half an emoji)."
    body = {"model": MODEL, "prompt": "Emojis: \U0001f600\U0001f389\U0001f525 \u4f60\u597d. More:", "max_tokens": 6, "temperature": 0,
            "logprobs": 1, **extra}
    whole = httpx.post(f"{url}/v1/completions", json=body, timeout=120).json()["choices"]
    with httpx.stream("POST", f"{url}/v1/completions", json={**body, "stream": True}, timeout=120) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    for choice in whole:
        mine = [c for chunk in chunks for c in chunk["choices"] if c["index"] == choice["index"]]
        assert [o for c in mine for o in c["logprobs"]["text_offset"]] == choice["logprobs"]["text_offset"]
        assert "".join(c["text"] for c in mine) == choice["text"]
    assert any(t.startswith("bytes:") for t in whole[0]["logprobs"]["tokens"])  # the case this test is about


def test_min_tokens_reaches_the_engine(client):
    r = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, temperature=0, extra_body={"min_tokens": 20})
    assert r.usage.completion_tokens >= 20
    with pytest.raises(openai.BadRequestError, match="min_tokens=31: expected at most max_tokens=30"):
        client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=30, extra_body={"min_tokens": 31})


def test_ignore_eos_and_exact_usage(client):
    r = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Say yes."}],
                                       max_completion_tokens=40, temperature=0, extra_body={"ignore_eos": True})
    assert (r.usage.completion_tokens, r.choices[0].finish_reason) == (40, "length")


# --- load, disconnects and faults -----------------------------------------------------------------------------------

def test_many_concurrent_streams_complete_and_leave_nothing_behind(url):
    n = 120
    before = metric(url, "nanoserve:generation_tokens_total")
    async def main():
        aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)
        async def one(i):
            stream = await aclient.completions.create(model=MODEL, prompt=f"Request {i}: count to ten.", max_tokens=4 + i % 8,
                                                      temperature=0.8, seed=i, stream=True, stream_options={"include_usage": True},
                                                      extra_body={"ignore_eos": True})
            parts = [p async for p in stream]
            return parts[-1].usage.completion_tokens, [p.choices[0].finish_reason for p in parts if p.choices][-1]
        return await asyncio.gather(*map(one, range(n)))
    results = asyncio.run(main())
    assert results == [(4 + i % 8, "length") for i in range(n)]
    assert wait_until_idle(url) == {"num_requests_running": 0, "num_requests_waiting": 0, "kv_cache_usage_perc": 0}
    assert metric(url, "nanoserve:generation_tokens_total") - before == sum(4 + i % 8 for i in range(n))


def _long_request(stream: bool) -> dict:
    return {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 400, "ignore_eos": True, "stream": stream}


def test_disconnect_mid_stream_aborts_and_frees_blocks(url, client, reference):
    aborted = metric(url, "nanoserve:request_success_total", finished_reason="abort")
    bystander = {}
    def run_bystander():
        bystander["text"] = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0).choices[0].text
    with httpx.stream("POST", f"{url}/v1/completions", json=_long_request(True), timeout=60) as r:
        events = r.iter_lines()
        got = []
        for line in events:
            if line.startswith("data:"): got.append(line)
            if len(got) == 3: break
        thread = threading.Thread(target=run_bystander)
        thread.start()
    # the client has hung up after 3 of 400 tokens: the abort must free its blocks long before 400 steps could run
    deadline = time.monotonic() + 5
    while metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 1
    thread.join()
    assert bystander["text"] == reference["prompts"][0].text
    assert wait_until_idle(url)["kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_leaves_aborts_every_choice(url, stream):
    aborted = metric(url, "nanoserve:request_success_total", finished_reason="abort")
    body = {**_long_request(stream), "prompt": ["Write a long story.", "Write a long poem."], "n": 2}
    if stream:
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as r:
            next(line for line in r.iter_lines() if line.startswith("data:"))
    else:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 5
    while metric(url, "nanoserve:request_success_total", finished_reason="abort") < aborted + 4 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 4
    assert wait_until_idle(url)["kv_cache_usage_perc"] == 0


def test_disconnect_while_waiting_for_a_plain_response_aborts(url, caplog):
    aborted = metric(url, "nanoserve:request_success_total", finished_reason="abort")
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(f"{url}/v1/completions", json=_long_request(False), timeout=httpx.Timeout(60, read=1.0))
    deadline = time.monotonic() + 5
    while metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 1
    assert wait_until_idle(url)["kv_cache_usage_perc"] == 0
    assert not [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]  # a hang-up is not a server error


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_leaves_before_the_engine_takes_its_prompts_has_none_computed(served, monkeypatch, stream):
    "The engine takes adds between steps: a client gone during a long step has its prompts aborted before the next one."
    url, engine = served
    step, slow, stepping, seen = engine.engine.step, threading.Event(), threading.Event(), set()
    def slow_step():  # a step of a second, as a long prefill on a CPU
        if not slow.is_set(): return step()
        stepping.set()
        time.sleep(1.0)
        outs = step()
        seen.update(out.request_id for out in outs)
        return outs
    monkeypatch.setattr(engine.engine, "step", slow_step)
    aborted = metric(url, "nanoserve:request_success_total", finished_reason="abort")
    body = {"model": MODEL, "prompt": ["Write a long story.", "Write a long poem."], "max_tokens": 16, "stream": stream}
    with httpx.stream("POST", f"{url}/v1/completions", json=_long_request(True), timeout=60) as blocker:
        lines = blocker.iter_lines()  # held: a dropped iterator would close the stream, and the blocker would be aborted
        next(line for line in lines if line.startswith("data:"))  # it runs: the engine steps
        slow.set(); stepping.clear()
        assert stepping.wait(10)
        with pytest.raises(httpx.ReadTimeout):  # sent at the start of a step; the client leaves 0.3 s later
            with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=httpx.Timeout(60, read=0.3)) as r: r.read()
        time.sleep(2.5)  # the step ends, the engine takes the two adds and their aborts, then steps on
        slow.clear()
    deadline = time.monotonic() + 5
    while metric(url, "nanoserve:request_success_total", finished_reason="abort") < aborted + 3 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert metric(url, "nanoserve:request_success_total", finished_reason="abort") == aborted + 3  # both prompts, the blocker
    assert len(seen) == 1  # the slow steps computed the blocker alone: neither prompt was prefilled for nobody
    assert wait_until_idle(url)["kv_cache_usage_perc"] == 0


def test_a_client_that_leaves_as_the_engine_takes_its_prompts_leaves_nothing_running():
    "The verdict and the hang-up in one event-loop turn, in every order: whatever the engine took is aborted, or answered."
    import types
    from nanoserve.protocol import CompletionRequest
    from nanoserve.server import OpenAIServer, unless_client_leaves
    class Engine:  # takes a prompt when `verdict` is set
        max_waiting = None
        def __init__(self, verdict): self.verdict, self.taken, self.aborted = verdict, [], []
        def check_room(self, n): pass
        async def add_request(self, ids, params):
            await self.verdict.wait()
            self.taken.append(types.SimpleNamespace(request_id=f"r{len(self.taken)}", finished=False))
            return self.taken[-1]
        def abort(self, request_id): self.aborted.append(request_id)
    class Request:  # the client hangs up when the verdict comes
        def __init__(self, event): self.event = event
        async def receive(self):
            await self.event.wait()
            return {"type": "http.disconnect"}
    async def run(turns: int):
        event = asyncio.Event()
        engine = Engine(event)
        server = types.SimpleNamespace(max_model_len=100, kv_capacity=10**6, sampling_defaults={}, tokenizer=None, engine=engine)
        req = CompletionRequest(model="m", prompt=[[1, 2, 3], [4, 5]], max_tokens=5)
        task = asyncio.ensure_future(unless_client_leaves(OpenAIServer.start(server, [[1, 2, 3], [4, 5]], req, 5, "max_tokens", "prompt"),
                                                          Request(event)))
        for _ in range(turns): await asyncio.sleep(0)
        event.set()
        return await task, engine
    for turns in range(6):
        streams, engine = asyncio.run(run(turns))
        if streams is None: assert sorted(engine.aborted) == sorted(s.request_id for s in engine.taken), turns  # 499: none left
        else: assert len(streams) == 2 and not engine.aborted  # answered: the handler's own watch takes over


def test_a_request_that_fails_in_the_engine_fails_alone(served, client, reference):
    url, engine = served
    poison, unaddable = [13, 13, 13, 13, 42], [13, 13, 13, 13, 43]
    original, original_add = engine.engine._record_token, engine.engine.add_request
    def faulty(req, row, logprobs):
        if req.seq.prompt_token_ids == poison: raise RuntimeError("injected fault")
        return original(req, row, logprobs)
    def faulty_add(request_id, prompt, params=None, **kw):
        if prompt == unaddable: raise RuntimeError("injected fault while adding")
        return original_add(request_id, prompt, params, **kw)
    engine.engine._record_token, engine.engine.add_request = faulty, faulty_add
    try:
        async def main():
            aclient = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
            async def healthy(prompt):
                return (await aclient.completions.create(model=MODEL, prompt=prompt, max_tokens=16, temperature=0)).choices[0].text
            async def poisoned_plain():
                with pytest.raises(openai.InternalServerError) as e:
                    await aclient.completions.create(model=MODEL, prompt=poison, max_tokens=16)
                return e.value.body
            async def poisoned_stream():
                with pytest.raises(openai.APIError) as e:
                    async for _ in await aclient.completions.create(model=MODEL, prompt=poison, max_tokens=16, stream=True): pass
                return e.value.message
            async def unaddable_plain():
                with pytest.raises(openai.InternalServerError) as e:
                    await aclient.completions.create(model=MODEL, prompt=unaddable, max_tokens=4)
                return e.value.body
            return await asyncio.gather(*map(healthy, PROMPTS), poisoned_plain(), poisoned_stream(), unaddable_plain())
        *texts, plain_error, stream_error, add_error = asyncio.run(main())
    finally:
        del engine.engine._record_token, engine.engine.add_request
    assert texts == [ref.text for ref in reference["prompts"]]
    assert plain_error["type"] == "server_error" and "injected fault" in plain_error["message"]
    assert "injected fault" in stream_error
    assert add_error["type"] == "server_error" and "injected fault while adding" in add_error["message"]
    assert client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=16, temperature=0).choices[0].text == reference["prompts"][0].text
    assert wait_until_idle(url)["kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("stopped", [False, True])
def test_a_failed_stream_ends_with_its_error_event_then_done(stopped):
    "Both stream kinds end a failed request with the error event and then [DONE], as vLLM does."
    from nanoserve.async_engine import EngineStopped, RequestFailed
    from nanoserve.server import chat_events, completion_events
    async def failing():
        raise EngineStopped("stopping") if stopped else RequestFailed("injected fault")
        yield  # an async generator
    async def events(make):
        return [e async for e in make([failing()], "cmpl-1", MODEL, None, True)]
    for make in (completion_events, chat_events):
        lines = [line for e in asyncio.run(events(make)) for line in e.splitlines() if line]
        error = json.loads(lines[-2].removeprefix("data: "))["error"]
        assert (error["code"], error["type"]) == ((503, "service_unavailable") if stopped else (500, "server_error"))
        assert lines[-1] == "data: [DONE]" and not any('"usage":{' in line for line in lines)


# --- bad input: each error status ------------------------------------------------------------------------------------

C, CHAT_PATH = "/v1/completions", "/v1/chat/completions"
BAD_REQUESTS = [
    (C, {"prompt": "hi", "temperature": 3}, 400, "temperature"),
    (C, {"prompt": "hi", "top_p": 0}, 400, "top_p"),
    (C, {"prompt": "hi", "n": 0}, 400, "n"),
    (C, {"prompt": "hi", "n": 129}, 400, "n"),
    (C, {"prompt": ["hi"] * 17, "n": 128}, 400, "prompt"),  # 2176 choices: more than one request may have (2048)
    (C, {"prompt": "hi", "n": 2, "best_of": 3}, 400, "best_of"),
    (C, {"prompt": [[1, 2], [1, 10**6]]}, 400, "prompt"),
    (C, {"prompt": [[1, 2], []]}, 400, "prompt"),
    (C, {"prompt": ["hi"] * 2049}, 400, "prompt"),
    (C, {"prompt": "hi", "presence_penalty": 2.5}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "min_tokens": -1}, 400, "min_tokens"),
    (C, {"prompt": "hi", "repetition_penalty": 0}, 400, "repetition_penalty"),
    (C, {"prompt": "hi", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"1": 101}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"1": 1, "01": 2}}, 400, "logit_bias"),  # one token, twice
    (C, {"prompt": "hi", "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"1": "1"}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"1": True}}, 400, "logit_bias"),
    (C, {"prompt": "hi", "logit_bias": {"99999999": 1}}, 400, "logit_bias"),  # checked by the engine, against the vocabulary
    (C, {"prompt": "hi", "stop_token_ids": [99999999]}, 400, "stop_token_ids"),
    (C, {"prompt": "hi", "logprobs": 1000}, 400, "logprobs"),
    (C, {"prompt": "hi", "max_tokens": 0}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
    (CHAT_PATH, {"messages": CHAT, "max_tokens": 3, "min_tokens": 5}, 400, "min_tokens"),
    (C, {"prompt": ["a", [1, 2]]}, 400, "prompt"),
    (C, {"prompt": "hi", "max_tokens": 100000}, 400, "max_tokens"),
    (C, {"prompt": "hello " * (MAX_MODEL_LEN + 10)}, 400, "prompt"),
    (C, {"prompt": [1, 2, 10**6]}, 400, "prompt"),
    (C, {"prompt": [True, 5]}, 400, "prompt[0]"),
    (C, {"prompt": ""}, 400, "prompt"),
    (C, {"prompt": "hi", "stream": 5}, 400, "stream"),
    (C, {"prompt": "hi", "stream_options": "x"}, 400, "stream_options"),
    (C, {"prompt": "hi", "stream_options": {"include_usage": True}}, 400, "stream_options"),
    (C, {"prompt": "hi", "stop": [str(i) for i in range(17)]}, 400, "stop"),
    (C, {"prompt": "hi", "logprobs": True}, 400, "logprobs"),
    (C, {"max_tokens": 4}, 400, "prompt"),
    (C, {"prompt": "hi", "stop": [""]}, 400, "stop"),
    (C, {"prompt": "hi", "seed": -2**70}, 400, "seed"),
    (C, {"prompt": "hi", "temperature": "warm"}, 400, "temperature"),
    (C, {"prompt": "hi", "model": "gpt-5"}, 404, "model"),
    (CHAT_PATH, {"messages": []}, 400, "messages"),
    (CHAT_PATH, {"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    (CHAT_PATH, {"messages": CHAT, "top_logprobs": 2}, 400, "top_logprobs"),
    (CHAT_PATH, {"messages": CHAT, "max_completion_tokens": 100000}, 400, "max_completion_tokens"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]}, 400, "messages"),
    (CHAT_PATH, {"messages": CHAT, "tools": [{"type": "function", "function": {"name": "f"}}]}, 400, "tool_choice"),  # auto
    (CHAT_PATH, {"messages": CHAT, "model": "gpt-5"}, 404, "model"),
    # a union's deepest error names the part at fault, not "should be a valid string"
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, 400,
     "messages[0].content[0].type"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].content[0].text"),
    (C, {"prompt": [1.0]}, 400, "prompt[0]"),
    (CHAT_PATH, {"messages": [{"content": "hi"}, {"role": "user", "content": [{"type": "text"}]}]}, 400, "messages[0].role"),
    # strict types: a boolean or a string is not a number, nor a number a boolean (pydantic's lax mode converts them)
    (C, {"prompt": "hi", "max_tokens": "3"}, 400, "max_tokens"),
    (C, {"prompt": "hi", "max_tokens": True}, 400, "max_tokens"),
    (C, {"prompt": "hi", "temperature": True}, 400, "temperature"),
    (C, {"prompt": "hi", "seed": "1"}, 400, "seed"),
    (C, {"prompt": "hi", "stream": "yes"}, 400, "stream"),
    (C, {"prompt": "hi", "ignore_eos": 1}, 400, "ignore_eos"),
    (C, {"prompt": "hi", "presence_penalty": "0"}, 400, "presence_penalty"),
    (C, {"prompt": "hi", "best_of": True}, 400, "best_of"),
    (CHAT_PATH, {"messages": CHAT, "logprobs": 1}, 400, "logprobs"),
    # the messages of a conversation with tools (more in tests/test_tool_calls.py)
    (CHAT_PATH, {"messages": [*CHAT, {"role": "tool", "content": "x"}]}, 400, "messages[1]"),
    (CHAT_PATH, {"messages": [*CHAT, {"role": "assistant", "content": None, "tool_calls": [{"id": "a"}]}]}, 400,
     "messages[1].tool_calls[0].function"),
    (CHAT_PATH, {"messages": [{"role": "user", "content": None}]}, 400, "messages[0]"),
]


@pytest.mark.parametrize("path,body,status,param", BAD_REQUESTS, ids=[f"{p[4:]}-{s}-{q}" for p, _, s, q in BAD_REQUESTS])
def test_bad_requests_get_openai_errors(url, path, body, status, param):
    r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["param"] == param and error["message"] and error["code"] == status
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")


VLLM_REFUSED = {"use_beam_search": True, "length_penalty": 0.5, "prompt_logprobs": 1, "allowed_token_ids": [1], "bad_words": ["x"],
                "truncate_prompt_tokens": 5, "spaces_between_special_tokens": False, "guided_grammar": "root ::= 'a'",
                "logits_processors": ["m.P"], "return_tokens_as_token_ids": True, "priority": 1, "cache_salt": "salt",
                "best_of": 2}  # vLLM honours each; nanoserve cannot (structured outputs: tests/test_structured_engine.py)


def test_vllm_fields_that_nanoserve_does_not_honour_are_refused_by_name_unless_at_their_defaults(url):
    chat_only = {"echo": True, "continue_final_message": True, "chat_template": "{{ messages }}", "documents": [{"text": "a"}],
                 "structural_tag": "{}", "chat_template_kwargs": {"tools": [{"type": "function"}]}}
    for path, base, fields in ((C, {"prompt": "hi"}, {**VLLM_REFUSED, "prompt_embeds": "AAAA"}),
                               (CHAT_PATH, {"messages": CHAT}, {**VLLM_REFUSED, **chat_only})):
        for name, value in fields.items():
            r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **base, name: value}, timeout=60)
            assert r.status_code == 400 and r.json()["error"]["param"] == name and name in r.json()["error"]["message"], (path, name, r.text)
    prefilled = [*CHAT, {"role": "assistant", "content": "The capital"}]  # the tester's request, which once started a new turn
    r = httpx.post(f"{url}{CHAT_PATH}", json={"model": MODEL, "messages": prefilled, "add_generation_prompt": False,
                                              "continue_final_message": True}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "continue_final_message"
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "bad_words": [], "spaces_between_special_tokens": True,
                "priority": 0, "guided_json": None, "return_tokens_as_token_ids": False, "best_of": 1, "response_format": {"type": "text"}}
    for path, base in ((C, {"prompt": "hi"}), (CHAT_PATH, {"messages": CHAT, "echo": False, "continue_final_message": False})):
        r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **base, **defaults}, timeout=60)
        assert r.status_code == 200, r.text


def test_a_chat_without_the_generation_prompt_is_the_conversation_as_rendered(url, reference):
    "vLLM's add_generation_prompt: false renders the conversation without the assistant's opening, as /tokenize does."
    body = {"model": MODEL, "messages": CHAT, "add_generation_prompt": False}
    ids = httpx.post(f"{url}/tokenize", json=body, timeout=60).json()["tokens"]
    r = httpx.post(f"{url}{CHAT_PATH}", json={**body, "max_tokens": 4, "temperature": 0, "ignore_eos": True}, timeout=60).json()
    want = reference["llm"].generate([ids], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True), use_tqdm=False)[0]
    assert r["usage"]["prompt_tokens"] == len(ids) < len(reference["chat"].prompt_token_ids)
    assert r["choices"][0]["message"]["content"] == want.text
    merged = {"model": MODEL, "messages": CHAT, "chat_template_kwargs": {"add_generation_prompt": False}}  # vLLM's merge: it wins
    assert httpx.post(f"{url}/tokenize", json=merged, timeout=60).json()["tokens"] == ids
    r = httpx.post(f"{url}{CHAT_PATH}", json={**merged, "max_tokens": 4, "temperature": 0, "ignore_eos": True}, timeout=60).json()
    assert r["usage"]["prompt_tokens"] == len(ids)
    for name in ("messages", "tokenize", "template", "chat_template"):  # the renderer's own arguments: a 400, not a TypeError's 500
        r = httpx.post(f"{url}{CHAT_PATH}", json={**merged, "chat_template_kwargs": {name: 1}}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs", (name, r.text)


def test_a_list_of_prompts_of_two_kinds_is_refused_as_such():
    "Pydantic alone reported the first union branch's error: 'prompt[0]: Input should be a valid integer'."
    from nanoserve.protocol import CompletionRequest
    with pytest.raises(ValueError, match="strings only, or lists of token ids only"): CompletionRequest(prompt=["a", [1, 2]])


def test_null_means_the_default(url):
    "OpenAI's schema lets these fields be null, meaning the default."
    for path, body in ((C, {"prompt": "hi", "n": None, "stream": None, "echo": None, "ignore_eos": None, "logprobs": None}),
                       (CHAT_PATH, {"messages": CHAT, "n": None, "stream": None, "logprobs": None})):
        r = httpx.post(f"{url}{path}", json={"model": MODEL, "max_tokens": 1, **body}, timeout=60)
        assert r.status_code == 200, r.text
    from nanoserve.protocol import CompletionRequest
    options = CompletionRequest(prompt="hi", stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None}).stream_options
    assert (options.include_usage, options.continuous_usage_stats) == (True, False)  # vLLM's defaults


def test_an_assistant_turn_without_content_is_accepted(url):
    messages = [*CHAT, {"role": "assistant", "content": None}, {"role": "user", "content": "And of Spain?"}]
    r = httpx.post(f"{url}{CHAT_PATH}", json={"model": MODEL, "messages": messages, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text


def test_a_million_bad_items_are_refused_without_stalling_other_requests(url):
    "Checks stop at a list's first bad item: pydantic once reported every item of every union branch, for seconds."
    for path, body, param in ((C, {"prompt": [None] * 10**6}, "prompt[0]"), (CHAT_PATH, {"messages": [None] * 10**6}, "messages[0]"),
                              (C, {"prompt": "hi", "logit_bias": {str(i): "x" for i in range(300_000)}}, "logit_bias")):
        start = time.monotonic()
        r = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
        assert time.monotonic() - start < 5, f"{param}: {time.monotonic() - start:.1f} s"  # 11 s before, on a 2-core CPU


def test_text_that_cannot_fit_is_refused_before_it_is_tokenized(served):
    url, engine = served
    longest = max(map(len, engine.tokenizer.backend.get_vocab()))
    bound = TEXT_MARGIN * MAX_MODEL_LEN * longest
    for path, body, param in ((C, {"prompt": "a" * (bound + 1)}, "prompt"),
                              (CHAT_PATH, {"messages": [{"role": "user", "content": "a" * (bound // 2 + 1)}] * 2}, "messages"),
                              # empty messages: the chat template's own text is what is too long
                              (CHAT_PATH, {"messages": [{"role": "user", "content": ""}] * (bound // 20)}, "messages")):
        error = httpx.post(f"{url}{path}", json={"model": MODEL, **body}, timeout=60).json()["error"]
        assert error["param"] == param and f"no token of its vocabulary is longer than {longest} characters" in error["message"]
    # at the bound it is tokenized, and then it is the token count that is too long
    error = httpx.post(f"{url}{C}", json={"model": MODEL, "prompt": "a" * bound}, timeout=60).json()["error"]
    assert error["param"] == "prompt" and "maximum context length is 512 tokens. However, you requested" in error["message"]


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(text=st.text(st.characters(exclude_categories=("Cs", "Cc")), min_size=1, max_size=400))
def test_no_token_stands_for_more_characters_than_its_vocabulary_entry(served, text):
    """What check_chars relies on (before its margin): n tokens never hold more than n times the longest entry's
    characters. Control characters are left out: SmolLM2's tokenizer drops six of them (U+0004, U+0006, ...)."""
    tokenizer = served[1].tokenizer
    longest = max(map(len, tokenizer.backend.get_vocab()))
    assert len(text) <= len(tokenizer.encode(text, add_special_tokens=False)) * longest


def test_a_too_long_prompt_is_named_once_in_the_message(url):
    r = httpx.post(f"{url}{CHAT_PATH}", json={"model": MODEL, "messages": [{"role": "user", "content": "hello " * MAX_MODEL_LEN}]})
    assert r.json()["error"]["message"].endswith("in the messages). Please reduce the length of the messages.")


@pytest.mark.parametrize("port", [-1, 65536, 99999, "80", True])
def test_a_port_outside_0_to_65535_is_refused_before_the_model_loads(port):
    with pytest.raises(ValueError, match="expected 0 to 65535"):
        make_server("/no/such/model", port=port)  # the model would fail to load, with another error


@pytest.fixture(scope="module")
def small_cache(tiny_chat_model):
    "A server whose KV cache (8 blocks of 16: 128 tokens) holds less than its context of 512 tokens."
    server = make_server(str(tiny_chat_model), port=0, max_model_len=512, num_kv_blocks=8, device="cpu", log_level="warning")
    with run_in_thread(server) as url: yield url


def test_a_kv_cache_smaller_than_the_context_caps_the_default_budget(small_cache):
    "Without max_tokens a request generates what the cache leaves, not what the context leaves; asking for more is a 400."
    for path, body in ((C, {"prompt": "hi", "max_tokens": None}), (CHAT_PATH, {"messages": CHAT})):
        r = httpx.post(f"{small_cache}{path}", json={**body, "ignore_eos": True}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["total_tokens"] == 128 and r.json()["choices"][0]["finish_reason"] == "length"
    error = httpx.post(f"{small_cache}{C}", json={"prompt": "hi", "max_tokens": 200}).json()["error"]
    assert error["param"] == "max_tokens" and "KV cache holds 128 tokens" in error["message"]
    assert httpx.post(f"{small_cache}{C}", json={"prompt": [5] * 200}).json()["error"]["param"] == "prompt"


@pytest.mark.parametrize("content,status,what", [
    (b"{'prompt': 'hi'", 400, "not valid JSON"),
    (b"[1, 2, 3]", 400, "not a JSON object"),
    (b"", 400, "missing"),
    (b'{"prompt": "\\ud800 lone surrogate"}', 400, "Unicode"),
    (b'{"prompt": "hi", "model": "\\ud800"}', 404, "does not exist"),
    (b'"a JSON string"', 400, "not a JSON object"),
    (b'{"prompt": "\xff hi"}', 400, "UnicodeDecodeError"),  # FastAPI's "error parsing the body", with its cause
    (b'{"prompt": ' + b"[" * 5000 + b"]" * 5000 + b"}", 400, "RecursionError"),
])
def test_malformed_bodies(url, content, status, what):
    r = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"})
    assert r.status_code == status and what in r.json()["error"]["message"]


@pytest.mark.parametrize("content,param,what", [
    (b'{"prompt": ["ok", "\\ud800"], "max_tokens": 2}', "prompt", "The text in prompt[1] is not valid Unicode"),
    (b'{"prompt": "hi", "stop": "\\ud800", "max_tokens": 2}', "stop", "The text is not valid Unicode"),
    (b'{"prompt": "hi", "stop": ["x", "\\udc00"], "max_tokens": 2}', "stop", "The text of stop[1] is not valid Unicode"),
])
def test_text_that_is_not_unicode_is_refused_where_it_stands(url, content, param, what):
    "A lone surrogate, which JSON carries and UTF-8 cannot: in a stop string it could never match; a 400 names it."
    error = httpx.post(f"{url}/v1/completions", content=content, headers={"content-type": "application/json"}).json()["error"]
    assert error["param"] == param and what in error["message"]


@pytest.mark.parametrize("headers", [{"content-type": "application/x-www-form-urlencoded"}, {"content-type": "text/plain"}, {}])
def test_a_json_body_without_its_content_type_is_told_so(url, headers):
    r = httpx.post(f"{url}/v1/completions", content=b'{"prompt": "hi"}', headers=headers)
    assert r.status_code == 400 and "Content-Type: application/json" in r.json()["error"]["message"]


def test_unknown_paths_and_methods(url):
    r = httpx.get(f"{url}/v1/nothing-here")
    assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert r.json()["error"]["message"] == "Not Found: GET /v1/nothing-here is no route of this server."
    r = httpx.get(f"{url}/v1/completions")
    assert r.status_code == 405 and r.json()["error"]["message"] == "Method Not Allowed: /v1/completions takes POST, not GET."
    r = httpx.post(f"{url}/v1/completions/", json={"prompt": "hi"})  # no bare redirect, which clients that do not follow see as empty
    assert r.status_code == 404 and r.json()["error"]["message"] == "Not Found: POST /v1/completions/ is no route of this server."


def test_openai_client_raises_its_exceptions(client):
    with pytest.raises(openai.NotFoundError): client.completions.create(model="gpt-5", prompt="hi")
    with pytest.raises(openai.BadRequestError) as e: client.completions.create(model=MODEL, prompt="hi", temperature=9)
    assert e.value.body["param"] == "temperature"


def test_oversize_body_gets_413(url):
    big = b'{"prompt": "' + b"a" * (9 * 2**20) + b'"}'
    r = httpx.post(f"{url}/v1/completions", content=big, headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 413 and r.json()["error"]["code"] == 413
    chunked = httpx.post(f"{url}/v1/completions", content=iter([big[i:i + 2**20] for i in range(0, len(big), 2**20)]),
                         headers={"content-type": "application/json"}, timeout=60)  # no Content-Length: counted as it comes
    assert chunked.status_code == 413


@pytest.fixture(scope="module")
def guarded(tiny_chat_model):
    "A server with an API key, a 4 KiB body limit, one sequence at a time and room for one waiting request."
    server = make_server(str(tiny_chat_model), port=0, api_key="secret", max_waiting=1, max_num_seqs=1, max_request_bytes=4096,
                         max_model_len=512, num_kv_blocks=64, device="cpu", log_level="warning")
    with run_in_thread(server) as url: yield url


def test_api_key_is_required_on_v1_only(guarded):
    assert httpx.get(f"{guarded}/health").status_code == 200 and httpx.get(f"{guarded}/metrics").status_code == 200
    assert httpx.get(f"{guarded}/version").status_code == 200  # no key needed, as for vLLM's
    for header in (None, "Bearer wrong", "secret", "Basic secret", "Bearer secretx", "Bearer"):
        r = httpx.get(f"{guarded}/v1/models", headers={"authorization": header} if header else {})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error", header
    assert "Bearer <key>" in httpx.get(f"{guarded}/v1/models", headers={"authorization": "Basic secret"}).json()["error"]["message"]
    for header in ("bearer secret", "BEARER secret", "Bearer  secret"):  # the scheme's case is not part of it (RFC 7235)
        assert httpx.get(f"{guarded}/v1/models", headers={"authorization": header}).status_code == 200, header
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{guarded}/v1", api_key="wrong", max_retries=0).models.list()
    keyed = openai.OpenAI(base_url=f"{guarded}/v1", api_key="secret", max_retries=0)
    assert keyed.completions.create(model=str(keyed.models.list().data[0].id), prompt="hi", max_tokens=3).usage.completion_tokens == 3


def test_body_limit_is_configurable(guarded):
    r = httpx.post(f"{guarded}/v1/completions", json={"prompt": "x" * 5000}, headers={"authorization": "Bearer secret"})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]


def test_overload_gets_503_with_retry_after(guarded):
    def ask(i):
        return httpx.post(f"{guarded}/v1/completions", json={"prompt": [1, 2, 3, i], "max_tokens": 200, "ignore_eos": True},
                          headers={"authorization": "Bearer secret"}, timeout=120)
    with ThreadPoolExecutor(20) as pool:
        replies = list(pool.map(ask, range(20)))
    codes = [r.status_code for r in replies]
    assert set(codes) == {200, 503} and codes.count(503) >= 10, codes
    for r in replies:
        if r.status_code == 503:
            assert r.headers["retry-after"] == "1" and r.json()["error"]["type"] == "service_unavailable"
            waiting = int(re.search(r"(\d+) requests are waiting already \(limit 1\)", r.json()["error"]["message"])[1])
            assert waiting >= 1  # the count that was tested against the limit, not the engine's queue alone (once "0")
        else: assert r.json()["usage"]["completion_tokens"] == 200
    assert wait_until_idle(guarded)["kv_cache_usage_perc"] == 0


@pytest.mark.parametrize("broken_part", ["_step", "_take_commands"])
def test_a_server_whose_engine_thread_dies_fails_its_requests_and_stops(tiny_chat_model, broken_part):
    server = make_server(str(tiny_chat_model), port=0, max_model_len=128, num_kv_blocks=32, device="cpu", log_level="critical")
    engine = server.config.app.state.server.engine
    with run_in_thread(server) as url:
        def broken(): raise RuntimeError("a bug in the engine loop")
        setattr(engine, broken_part, broken)  # the loop itself fails, not a step it guards
        r = httpx.post(f"{url}/v1/completions", json={"prompt": "hi", "max_tokens": 4}, timeout=30)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
        deadline = time.monotonic() + 10
        while not server.should_exit and time.monotonic() < deadline: time.sleep(0.05)
        assert server.should_exit and isinstance(engine.error, RuntimeError)


# --- a fuzz from the server's own OpenAPI schema ------------------------------------------------------------------

@pytest.fixture(scope="module")
def fuzz_url(tiny_chat_model):
    server = make_server(str(tiny_chat_model), port=0, max_model_len=128, num_kv_blocks=256, device="cpu", log_level="critical")
    with run_in_thread(server) as url: yield url


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE])
def test_no_generated_request_gets_a_5xx(fuzz_url, mode):
    "Requests generated from the server's own OpenAPI schema, valid ones and invalid ones: a 5xx would be a bug."
    schema = schemathesis.openapi.from_url(f"{fuzz_url}/openapi.json")
    seen = []
    @given(case=schema.as_strategy(mode))
    @settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)
    def no_5xx(case):
        response = case.call(timeout=60)
        seen.append(response.status_code)
        assert response.status_code < 500, (case.method, case.path, case.body, response.status_code, response.text[:500])
    no_5xx()
    assert len(seen) >= 100 and (200 in seen if mode == schemathesis.GenerationMode.POSITIVE else 400 in seen)


# --- SIGTERM ----------------------------------------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("engine_process", ["--engine-process", "--no-engine-process"])
def test_sigterm_finishes_or_aborts_running_requests_and_exits_0(engine_process):
    server = ServeProcess(engine_process, "--max-model-len", "2048", "--num-kv-blocks", "160", "--timeout-graceful-shutdown", "8")
    proc = server.proc
    try:
        base = server.base()
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        short = iter(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, stream=True, extra_body={"ignore_eos": True}))
        long = iter(client.completions.create(model=MODEL, prompt="Write a long story.", max_tokens=2000, stream=True,
                                              extra_body={"ignore_eos": True}))
        first_short, first_long = next(short), next(long)
        proc.send_signal(signal.SIGTERM)
        rest_short = list(short)  # 6 tokens finish inside the 8 s drain, even on a slow, busy CPU
        assert 1 + len(rest_short) == 6 and rest_short[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.APIError) as e:  # 2000 tokens do not: aborted, and told so
            for _ in long: pass
        assert "shutting down" in e.value.message or "stopped" in e.value.message
        assert proc.wait(timeout=60) == 0
        with pytest.raises(httpx.ConnectError): httpx.get(f"{base}/health")
    finally:
        out = server.output()
    assert "Traceback" not in out, out


def _children(pid: int) -> list:
    "The pids of a process's children (Linux)."
    try: return [int(c) for c in open(f"/proc/{pid}/task/{pid}/children").read().split()]
    except OSError: return []

def _cmdline(pid: int) -> str:
    try: return open(f"/proc/{pid}/cmdline").read().replace("\0", " ")
    except OSError: return ""


@pytest.mark.slow
def test_a_second_ctrl_c_ends_the_drain_at_once():
    "Ctrl-C drains for --timeout-graceful-shutdown seconds; a second Ctrl-C (uvicorn's force exit) aborts what still runs now."
    server = ServeProcess("--max-model-len", "2048", "--num-kv-blocks", "160", "--timeout-graceful-shutdown", "60")
    proc = server.proc
    try:
        base = server.base()
        body = {"model": MODEL, "prompt": "Write a long story.", "max_tokens": 2000, "stream": True, "ignore_eos": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as r:
            events = r.iter_lines()
            assert next(e for e in events if e.startswith("data:"))  # running
            proc.send_signal(signal.SIGINT)
            time.sleep(1.0)
            start = time.monotonic()
            proc.send_signal(signal.SIGINT)
            rest = [e for e in events if e.startswith("data:")]
        assert proc.wait(timeout=30) == 0 and time.monotonic() - start < 15  # not the 60 s drain
        assert "shutting down" in json.loads(rest[-2][5:])["error"]["message"] and rest[-1] == "data: [DONE]"
    finally:
        out = server.output()
    assert "Traceback" not in out, out


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"), reason="needs /proc/PID/task/PID/children")
def test_sigterm_while_the_model_loads_stops_the_engine_process_too():
    server = ServeProcess("--max-model-len", "256")
    proc = server.proc
    try:
        deadline, engine = time.monotonic() + 60, []
        while not engine:  # the engine process has started (beside multiprocessing's resource tracker): the model is loading
            assert proc.poll() is None and time.monotonic() < deadline, "no engine process"
            time.sleep(0.02)
            engine = [c for c in _children(proc.pid) if "spawn_main" in _cmdline(c)]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) in (143, 0)  # SIGTERM's usual status; 0 if the model had loaded and the server drained
        assert not os.path.exists(f"/proc/{engine[0]}") or "spawn_main" not in _cmdline(engine[0])  # not left loading alone
    finally:
        out = server.output()
    assert "Traceback" not in out, out


def test_the_port_is_held_from_before_the_model_loads():
    from nanoserve.server import listen
    [held] = listen("127.0.0.1", 0)
    try:
        with pytest.raises(RuntimeError, match="Address already in use"):  # SO_REUSEADDR, as uvicorn and asyncio set it
            listen("127.0.0.1", held.getsockname()[1])
    finally: held.close()


def test_serve_refuses_a_port_in_use_before_loading_the_model():
    with socket.create_server(("127.0.0.1", 0)) as taken:
        port = taken.getsockname()[1]
        start = time.monotonic()
        run = subprocess.run([sys.executable, "-m", "nanoserve", "serve", "--port", str(port), "--device", "cpu"],
                             capture_output=True, text=True, timeout=120)
    assert run.returncode == 1 and f"cannot listen on 127.0.0.1:{port}: Address already in use" in run.stderr
    assert "KV cache" not in run.stderr and "Traceback" not in run.stderr and time.monotonic() - start < 60


def test_serve_collects_young_objects_less_often_in_its_own_process(monkeypatch):
    "`nanoserve serve` raises the first GC threshold while it serves (streaming outputs make many young token lists), then restores it."
    import gc
    import nanoserve.server as server_module

    seen = {}
    class FakeServer:  # what serve() needs of make_server's result
        class config:
            class app:
                class state:
                    class server: model_name = "m"
        class engine:
            error = None
            def shutdown(timeout): seen["shutdown"] = timeout
        def handle_exit(self, sig, frame): pass
        def run(self, sockets=None): seen["threshold"] = gc.get_threshold()

    saved = gc.get_threshold()
    monkeypatch.setattr(server_module, "make_server", lambda *a, **k: FakeServer())
    try:
        assert server_module.serve(port=0) == 0
        restored = gc.get_threshold()
    finally:
        gc.set_threshold(*saved)
    assert seen["threshold"] == (server_module.SERVER_GC_THRESHOLD, *saved[1:]) and server_module.SERVER_GC_THRESHOLD > saved[0]
    assert seen["shutdown"] == 0  # serve leaves no engine running, however the server ends
    assert restored == saved  # only while it serves


@pytest.mark.parametrize("engine_process", [False, True])
def test_chat_template_given_to_the_server_renders_every_conversation(tiny_chat_model, engine_process):
    "vLLM's --chat-template: a template (or its file) instead of the model's, for chat requests, /tokenize and /tokenizer_info."
    template = "{{ prefix }}{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}"
    with pytest.raises(ValueError, match="chat_template: line 1"):
        make_server(str(tiny_chat_model), port=0, chat_template="{% for %}", device="cpu")
    server = make_server(str(tiny_chat_model), port=0, max_model_len=128, num_kv_blocks=32, device="cpu", log_level="warning",
                         engine_process=engine_process, chat_template=template)
    tok = LLM(tiny_chat_model, max_model_len=128, num_kv_blocks=8, device="cpu").get_tokenizer()
    want = tok.encode("[user] What is the capital of France?\n[assistant] ", add_special_tokens=False)
    with run_in_thread(server) as url:
        assert httpx.post(f"{url}/tokenize", json={"messages": CHAT}, timeout=60).json()["tokens"] == want
        assert httpx.get(f"{url}/tokenizer_info", timeout=60).json()["chat_template"] == template
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60).json()
        assert chat["usage"]["prompt_tokens"] == len(want)
        variables = {"messages": CHAT, "chat_template_kwargs": {"prefix": "Q&A\n"}}  # vLLM's: more variables for the template
        prefixed = tok.encode("Q&A\n[user] What is the capital of France?\n[assistant] ", add_special_tokens=False)
        assert httpx.post(f"{url}/tokenize", json=variables, timeout=60).json()["tokens"] == prefixed
        chat = httpx.post(f"{url}/v1/chat/completions", json={**variables, "max_tokens": 2}, timeout=60).json()
        assert chat["usage"]["prompt_tokens"] == len(prefixed)


@pytest.mark.parametrize("engine_process", [False, True])
def test_requests_start_from_the_models_generation_config_and_override_it(tiny_chat_model, tmp_path, caplog, engine_process):
    """As vLLM's --generation-config auto: a request without temperature takes the model's, and a chat request without
    max_tokens its max_new_tokens (a completion's max_tokens defaults to 16, OpenAI's); the request's own fields win."""
    model = tmp_path / "with-defaults"
    shutil.copytree(tiny_chat_model, model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.0, "top_k": 7, "max_new_tokens": 3}))
    with caplog.at_level(logging.INFO, logger="nanoserve.server"):
        server = make_server(str(model), port=0, max_model_len=128, num_kv_blocks=32, device="cpu", log_level="warning",
                             engine_process=engine_process)
    assert "'temperature': 0.0, 'top_k': 7, 'max_tokens': 3" in caplog.text
    llm = LLM(model, max_model_len=128, num_kv_blocks=32, device="cpu")
    greedy = lambda n: llm.generate(["Hello there"], SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), use_tqdm=False)[0].text
    with run_in_thread(server) as url:
        post = lambda body: httpx.post(f"{url}/v1/completions", json={"prompt": "Hello there", "ignore_eos": True, **body}, timeout=60).json()
        defaulted = post({})
        assert defaulted["usage"]["completion_tokens"] == 16 and defaulted["choices"][0]["text"] == greedy(16)  # the model's temperature
        chat = httpx.post(f"{url}/v1/chat/completions", json={"messages": CHAT, "ignore_eos": True}, timeout=60).json()
        assert chat["usage"]["completion_tokens"] == 3  # the model's max_new_tokens
        assert post({"max_tokens": 6})["choices"][0]["text"] == greedy(6)
        sampled = [post({"max_tokens": 6, "temperature": 1.0, "seed": s})["choices"][0]["text"] for s in range(4)]
        assert any(text != greedy(6) for text in sampled)  # the request's own temperature wins
    from nanoserve.protocol import CompletionRequest, sampling_params
    params = sampling_params(CompletionRequest(prompt="x", temperature=0.5), 9, 0, {"temperature": 0.0, "top_k": 7, "max_tokens": 3})
    assert (params.temperature, params.top_k, params.max_tokens) == (0.5, 7, 9)


# --- findings of a fuzzing review (2026-11-29) -------------------------------------------------------------------------

def test_json_nested_deeper_than_python_reads_is_a_400_or_text(url):
    "JSON text nested past Python's recursion limit: a RecursionError, which was a 500; now a 400 naming it, or plain text."
    deep = "[" * 5000 + "]" * 5000
    for body, param in (({"guided_json": deep}, "guided_json"), ({"structured_outputs": {"json": deep}}, "structured_outputs")):
        r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param and "RecursionError" in r.json()["error"]["message"], r.text
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": deep}}  # a template gets such arguments as text
    messages = [*CHAT, {"role": "assistant", "content": None, "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "ok"}]
    for path, body in (("/v1/chat/completions", {"model": MODEL, "messages": messages, "max_tokens": 2}), ("/tokenize", {"messages": messages})):
        r = httpx.post(f"{url}{path}", json=body, timeout=60)
        assert r.status_code == 200, r.text


def test_a_pattern_that_needs_a_byte_no_token_holds_is_a_400(url):
    "SmolLM2's vocabulary has no token for byte 0x04: such a pattern was a 500 from the engine's first step; now the engine refuses it."
    for body in ({"guided_regex": "\u0004{3}"}, {"guided_choice": ["\u0004"]}):
        for stream in (False, True):
            r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "stream": stream, **body}, timeout=60)
            assert r.status_code == 400 and "no token of this model's vocabulary" in r.json()["error"]["message"], r.text
    r = httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 4, "guided_regex": "a|\u0004"}, timeout=60)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "a"  # a pattern with another way is served


def test_a_messages_name_reaches_the_chat_template(tiny_chat_model):
    "vLLM passes a message's `name` to the template; it was dropped. A server's --chat-template that prints it shows it."
    template = "{% for m in messages %}{{ m.role }}{% if m.name %} ({{ m.name }}){% endif %}: {{ m.content }}\n{% endfor %}"
    server = make_server(str(tiny_chat_model), port=0, max_model_len=128, num_kv_blocks=16, device="cpu", log_level="warning",
                         chat_template=template)
    messages = [{"role": "user", "content": "hi", "name": "Alice"}, {"role": "user", "content": "yo"}]
    with run_in_thread(server) as url:
        r = httpx.post(f"{url}/tokenize", json={"messages": messages, "add_generation_prompt": False}, timeout=60)
        assert r.status_code == 200, r.text
        text = httpx.post(f"{url}/detokenize", json={"tokens": r.json()["tokens"]}, timeout=60).json()["prompt"]
    assert text == "user (Alice): hi\nuser: yo\n"


def test_a_bug_in_a_stream_ends_it_with_an_error_event_and_done():
    "An exception escaping a stream's events (a RecursionError in a parser was one) no longer cuts the connection."
    from nanoserve.server import guarded
    async def events():
        yield "data: first\n\n"
        raise RecursionError("deep")
    async def collect(): return [e async for e in guarded(events())]
    first, error = asyncio.run(collect())
    assert first == "data: first\n\n" and "\"type\":\"server_error\"" in error and "RecursionError" in error and error.endswith("data: [DONE]\n\n")
