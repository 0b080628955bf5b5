"Structured output (chapter 6c) in chapter 7's generate, the engine (11b) and the server (12b/12c)."
import json, math, re, time

import httpx
import openai
import pytest
import torch

from nanoserve import LLM, SamplingParams
from nanoserve.engine import LLMEngine
from nanoserve.generate import generate
from nanoserve.loader import DEFAULT_MODEL, load_model
from nanoserve.server import make_server, run_in_thread
from nanoserve.speculative import speculative_generate
from nanoserve.structured import StructuredOutputs
from nanoserve.testing import save_tiny_model
from nanoserve.tokenizer import load_tokenizer

DATE = r"(19|20)\d\d-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])"
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"},
                                           "colour": {"enum": ["red", "green", "blue"]}},
          "required": ["name", "age", "colour"]}
PROMPTS = ["The date of the moon landing is", "Describe a person as JSON:", "Is the sky blue? Answer:", "1, 2, 3,"]
SPECS = [StructuredOutputs(regex=DATE), StructuredOutputs(json=SCHEMA), StructuredOutputs(choice=["yes", "no", "maybe"]), None]


NESTED_ARRAYS, DEEP_OBJECTS = {"type": "integer"}, {"type": "integer"}
for _ in range(17): NESTED_ARRAYS = {"type": "array", "items": NESTED_ARRAYS}
for _ in range(200): DEEP_OBJECTS = {"type": "object", "properties": {"x": DEEP_OBJECTS}, "required": ["x"]}


def follows(spec: StructuredOutputs | None, text: str) -> bool:
    "Whether `text` is a whole match of `spec` (no spec: anything)."
    if spec is None: return True
    if spec.regex is not None: return re.fullmatch(spec.regex, text) is not None
    if spec.choice is not None: return text in spec.choice
    value = json.loads(text)
    return (set(value) == {"name", "age", "colour"} and isinstance(value["name"], str) and len(value["name"]) <= 12
            and type(value["age"]) is int and value["colour"] in ("red", "green", "blue"))


@pytest.fixture(scope="module")
def llm(): return LLM(max_model_len=512, num_kv_blocks=128, device="cpu")


def params_for(spec, **kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 48, **kw}, structured_outputs=spec)


def test_the_engine_follows_each_rows_constraint_and_leaves_the_others_alone(llm):
    outs = llm.generate(PROMPTS, [params_for(s) for s in SPECS], use_tqdm=False)
    for spec, out in zip(SPECS[:-1], outs):
        assert out.outputs[0].finish_reason == "stop" and follows(spec, out.outputs[0].text), (spec, out.outputs[0].text)
    alone = llm.generate(PROMPTS[-1:], params_for(None), use_tqdm=False)[0]
    assert alone.outputs[0].token_ids == outs[-1].outputs[0].token_ids  # the masks of other rows do not leak into it
    free = llm.generate(PROMPTS[:1], params_for(None), use_tqdm=False)[0].outputs[0].text
    assert not follows(SPECS[0], free)  # the constraint changed the answer: without it the model writes something else


def test_chapter_7_sync_async_and_preempted_engines_agree(llm):
    model, tok = load_model(device="cpu", dtype=torch.float32), load_tokenizer()
    want = [generate(model, tok, tok.encode(p), params_for(s)).token_ids for p, s in zip(PROMPTS, SPECS)]
    assert [o.outputs[0].token_ids for o in llm.generate(PROMPTS, [params_for(s) for s in SPECS], use_tqdm=False)] == want
    for engine in (LLM(max_model_len=512, num_kv_blocks=128, device="cpu", async_scheduling=True),
                   LLM(max_model_len=512, num_kv_blocks=12, block_size=16, device="cpu", async_scheduling=True)):  # preempts
        outs = engine.generate(PROMPTS, [params_for(s) for s in SPECS], use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want


def test_sampled_choices_each_follow_the_schema(llm):
    params = SamplingParams(temperature=1.0, seed=7, n=4, max_tokens=60, structured_outputs=SPECS[1])
    out = llm.generate(["A person:"], params, use_tqdm=False)[0]
    assert len(out.outputs) == 4
    for c in out.outputs:
        assert c.finish_reason == "stop" and follows(SPECS[1], c.text), c.text


def test_bad_constraints_are_value_errors_that_name_the_problem(llm, tmp_path):
    with pytest.raises(ValueError, match="structured_outputs"): SamplingParams(structured_outputs="[a-z]+")
    with pytest.raises(ValueError, match="min_tokens"): SamplingParams(min_tokens=1, structured_outputs=SPECS[0])
    with pytest.raises(ValueError, match="regex|pattern|position"):
        llm.generate(["x"], SamplingParams(structured_outputs=StructuredOutputs(regex="(ab")), use_tqdm=False)
    d = save_tiny_model("llama", tmp_path / "tiny")  # weights and a config, no tokenizer
    with pytest.raises(ValueError, match="tokenizer"):
        LLM(str(d), num_kv_blocks=16, device="cpu").generate([[1, 2]], params_for(SPECS[0]), use_tqdm=False)
    model, tok = load_model(device="cpu", dtype=torch.float32), load_tokenizer()
    with pytest.raises(ValueError, match="structured_outputs"):
        speculative_generate(model, tok, tok.encode("x"), params_for(SPECS[0]))


def test_packed_masks_mask_as_bool_masks_do():
    "Chapter 6b's allow_tokens: bits packed by numpy and bool tensors give the same logits, rows without a mask untouched."
    import numpy as np
    from nanoserve.sampling import allow_tokens
    g = torch.Generator().manual_seed(0)
    for V in (5, 8, 13, 49152):
        logits, masks = torch.randn(3, V, generator=g), torch.rand(3, V, generator=g) < 0.3
        as_bool = allow_tokens(logits.clone(), [masks[0], None, masks[2]])
        as_bits = allow_tokens(logits.clone(), [np.packbits(masks[0].numpy(), bitorder="little"), None,
                                                 np.packbits(masks[2].numpy(), bitorder="little")])
        want = logits.clone()
        want[0][~masks[0]] = want[2][~masks[2]] = -math.inf
        assert torch.equal(as_bool, want) and torch.equal(as_bits, want)
    with pytest.raises(ValueError, match="masks"): allow_tokens(torch.zeros(1, 16), [np.zeros(3, np.uint8)])


# --- the server ------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def url():
    server = make_server(port=0, max_model_len=512, num_kv_blocks=200, device="cpu", log_level="warning")
    with run_in_thread(server) as u: yield u


def test_the_server_takes_openais_and_vllms_names(url):
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Describe a person."}],
                                       temperature=0, max_tokens=60,
                                       response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}})
    assert follows(SPECS[1], r.choices[0].message.content), r.choices[0].message.content
    r = client.chat.completions.create(model=DEFAULT_MODEL, messages=[{"role": "user", "content": "Give me JSON."}],
                                       temperature=0, max_tokens=60, response_format={"type": "json_object"})
    assert r.choices[0].finish_reason != "stop" or isinstance(json.loads(r.choices[0].message.content), dict)
    for extra, spec in (({"guided_regex": DATE}, SPECS[0]), ({"guided_choice": ["yes", "no", "maybe"]}, SPECS[2]),
                        ({"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, SPECS[2]), ({"guided_json": SCHEMA}, SPECS[1])):
        r = client.completions.create(model=DEFAULT_MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=60, extra_body=extra)
        assert follows(spec, r.choices[0].text), (extra, r.choices[0].text)
    chunks = client.completions.create(model=DEFAULT_MODEL, prompt=PROMPTS[0], temperature=0, max_tokens=60, stream=True,
                                       extra_body={"guided_regex": DATE})
    assert follows(SPECS[0], "".join(c.choices[0].text for c in chunks))


def test_the_engine_process_takes_structured_requests_too():
    "nanoserve serve's default: the engine in a process of its own, StructuredOutputs crossing the pipe in SamplingParams."
    server = make_server(port=0, max_model_len=512, num_kv_blocks=64, device="cpu", log_level="warning", engine_process=True)
    with run_in_thread(server) as u:
        r = httpx.post(f"{u}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": PROMPTS[0], "max_tokens": 30, "temperature": 0,
                                                    "structured_outputs": {"regex": DATE}}, timeout=120)
        assert r.status_code == 200 and follows(SPECS[0], r.json()["choices"][0]["text"]), r.text
        assert_a_dead_end_is_the_clients_error(u)


def assert_a_dead_end_is_the_clients_error(u: str):
    """'a' and then byte 0x04, which no token of SmolLM2 holds: the first token is allowed, the second has none. That was
    a 500, or a server_error event; it is a 400 (an invalid_request_error event once the stream's 200 is out)."""
    body = {"model": DEFAULT_MODEL, "prompt": PROMPTS[0], "max_tokens": 5, "guided_regex": "a\u0004"}
    r = httpx.post(f"{u}/v1/completions", json=body, timeout=120)
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error", r.text
    assert "no token of this model's vocabulary continues the text so far" in r.json()["error"]["message"], r.text
    with httpx.stream("POST", f"{u}/v1/completions", json={**body, "stream": True}, timeout=120) as s:
        events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
    assert s.status_code == 200 and events[-1] == "[DONE]"
    error = json.loads(events[-2])["error"]
    assert (error["code"], error["type"]) == (400, "invalid_request_error") and "no token of this model" in error["message"]
    sent = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])  # the "a" before the dead end, unless the
    assert sent in ("", "a")  # error replaced its output unread


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_token_before_a_dead_end_is_kept_and_may_finish_the_request(async_scheduling):
    """One step ahead, the empty mask after "a" is found before the "a" itself is recorded: that token is still kept, and
    a stop string or max_tokens it meets ends the request as one step at a time does, with no error."""
    llm = LLM(max_model_len=128, num_kv_blocks=16, device="cpu", async_scheduling=async_scheduling)
    dead_end = dict(temperature=0, structured_outputs=StructuredOutputs(regex="a\x04"))
    failed, stopped, done = llm.generate([PROMPTS[0]] * 3, [SamplingParams(max_tokens=5, **dead_end),
                                         SamplingParams(max_tokens=5, stop=["a"], **dead_end),
                                         SamplingParams(max_tokens=1, **dead_end)], use_tqdm=False)
    assert (failed.text, failed.finish_reason) == ("a", "abort") and failed.error.startswith("UnsatisfiableRequest: "), failed
    assert (stopped.text, stopped.finish_reason, stopped.error) == ("", "stop", None)
    assert (done.text, done.finish_reason, done.error) == ("a", "length", None)


def test_a_dead_end_found_while_no_token_is_in_flight_stays_the_clients_error():
    """One step ahead, a request that sat out a step (B's prefill ran alone) finds its dead end with no token in flight.
    The token it then samples without a mask is in flight when the next masks are made: that must not replace the
    request's UnsatisfiableRequest with the ValueError of a forbidden token (a 500, read as a bug)."""
    engine = LLMEngine(None, max_model_len=128, num_kv_blocks=16, device="cpu", async_scheduling=True)
    params = lambda: SamplingParams(max_tokens=5, temperature=0, structured_outputs=StructuredOutputs(regex="a\x04"))
    engine.add_request("A", PROMPTS[0], params())
    finished = {o.request_id: o for o in engine.step() if o.finished}
    engine.add_request("B", PROMPTS[0], params())
    while engine.has_unfinished(): finished.update((o.request_id, o) for o in engine.step() if o.finished)
    for out in finished.values():
        assert (out.text, out.finish_reason) == ("a", "abort") and out.error.startswith("UnsatisfiableRequest: "), out


def test_a_pattern_that_dead_ends_after_its_first_token_is_the_clients_error(url):
    assert_a_dead_end_is_the_clients_error(url)


@pytest.mark.parametrize("body,param", [
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_regex": "a{5,2}"}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_json": {"type": "object", "patternProperties": {"a": {}}}}, "guided_json"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"structured_outputs": {"grammar": "root ::= 'a'"}}, "structured_outputs"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"guided_regex": "a+", "guided_choice": ["a"]}, None),
    ({"guided_regex": "a+", "min_tokens": 2}, None),  # a complete match could leave nothing to draw
    # found by a review: each once froze the server, exhausted its memory, was a 500, or failed in mid-generation
    ({"guided_json": NESTED_ARRAYS}, "guided_json"),  # a 17-deep schema: a 3.7 MB regex, 25 s of a blocked event loop
    ({"guided_json": {"oneOf": [{"type": "string", "pattern": "^a{0,900}%s$" % chr(98 + i)} for i in range(20)]}}, "guided_json"),
    ({"guided_regex": "(?:a" * 400 + ")" * 400}, "guided_regex"),  # a RecursionError, once a 500
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "deep", "schema": DEEP_OBJECTS}}}, "response_format"),
    ({"guided_regex": "(?:.*[ae].{30})"}, "guided_regex"),  # a DFA past 20,000 states: once accepted, then failed mid-way
])
def test_bad_structured_requests_are_400s(url, body, param):
    t0 = time.monotonic()
    r = httpx.post(f"{url}/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 2, **body}, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert param is None or error["param"].split(".")[0] == param, error  # e.g. response_format.type
    assert time.monotonic() - t0 < 5, "refused, but slowly"
    assert httpx.get(f"{url}/health", timeout=5).status_code == 200


def test_building_constraints_leaves_the_event_loop_free(url):
    "Automata of large patterns (0.2-0.5 s each) are built in worker threads: the server answers /health meanwhile."
    import asyncio

    async def main():
        async with httpx.AsyncClient(base_url=url, timeout=60) as client:
            patterns = [f"[{a}{b}]*{a}[{a}{b}]{{13}}" for a, b in ("cd", "ef", "gh", "ij")]  # 2^14 states each, new to the caches
            start = time.monotonic()
            posts = [asyncio.create_task(client.post("/v1/completions", json={"model": DEFAULT_MODEL, "prompt": "hi", "max_tokens": 1,
                                                                              "guided_regex": p})) for p in patterns]
            waits = []
            while not all(p.done() for p in posts):
                t0 = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                waits.append(time.monotonic() - t0)
                await asyncio.sleep(0.01)
            assert all(p.result().status_code == 200 for p in posts), [p.result().text for p in posts]
            return waits, time.monotonic() - start

    t0 = time.monotonic()
    StructuredOutputs(regex="[kl]*k[kl]{13}")  # one such build, here, on this machine as loaded as it is
    one_build = time.monotonic() - t0
    waits, total = asyncio.run(main())
    # on the event loop the four builds ran in a row while /health waited, four builds long (1.6 s against 0.46 s for one)
    assert len(waits) >= 5 and max(waits) < 2 * one_build, (one_build, total, waits)
