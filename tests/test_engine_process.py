"""Chapter 12e: the engine in a child process behind AsyncLLMEngine's interface. Outputs equal LLM.generate's (stop
strings and log probabilities included); aborts free blocks in the child; refusals, overload, shutdown and a killed
engine process each end their requests with the right error; the server runs on it unchanged."""
import asyncio, os, pickle, re, signal, socket, subprocess, sys, time

import httpx
import numpy as np
import openai
import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.async_engine import EngineOverloaded, EngineStopped, RequestFailed, RequestStream
from nanoserve.engine import PromptLogprobs, RequestMetrics, TokenLogprobs
from nanoserve.engine_process import DeltaTracker, EngineProcess, OutputAssembly, OutputDelta
from nanoserve.loader import DEFAULT_MODEL
from nanoserve.server import make_server, run_in_thread

OPTIONS = dict(max_model_len=256, num_kv_blocks=96, device="cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time"]
PARAMS = [SamplingParams(temperature=0, max_tokens=16), SamplingParams(temperature=0, max_tokens=16, stop=["\n"]),
          SamplingParams(temperature=0.8, seed=3, max_tokens=16, logprobs=2, prompt_logprobs=1)]


@pytest.fixture(scope="module")
def llm():
    return LLM(**OPTIONS)


@pytest.fixture(scope="module")
def remote():
    engine = EngineProcess(**OPTIONS).start()
    yield engine
    engine.shutdown(5)


async def last_output(engine, prompt, params):
    out = None
    async for out in engine.generate(prompt, params): pass
    return out


def test_delta_round_trip_rebuilds_every_output(llm):
    engine = llm.llm_engine
    for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)): engine.add_request(f"d{i}", prompt, params)
    tracker, assemblies = DeltaTracker(), {}
    while engine.has_unfinished():
        for out in engine.step():
            a = assemblies.setdefault(out.request_id, OutputAssembly(out.request_id, out.prompt, out.prompt_token_ids, 0.0))
            d = tracker.delta(out)
            a.apply(d)
            rebuilt = a.output(d)
            assert (rebuilt.text, rebuilt.token_ids, rebuilt.finished, rebuilt.finish_reason, rebuilt.logprobs, rebuilt.prompt_logprobs) == \
                   (out.text, out.token_ids, out.finished, out.finish_reason, out.logprobs, out.prompt_logprobs)
    assert not tracker.sent  # finished requests are forgotten


def test_a_stream_makes_the_output_of_an_assembly_when_its_reader_takes_it():
    "The receiver hands over the assembly itself: what the reader gets has every delta applied so far, and is a snapshot."
    def delta(a, text, ids, *end): return OutputDelta("r", len(a.text), text, ids, None, *end)
    async def main():
        stream, a = RequestStream("r", asyncio.get_running_loop()), OutputAssembly("r", "p", [1, 2], 0.0)
        for i in range(3):
            a.apply(delta(a, f"t{i}", [i]))
            stream._deliver(a)
        assert len(stream.pending) == 1  # an unread running output is replaced, here by itself
        first = await anext(stream)
        assert (first.text, first.token_ids, first.finished) == ("t0t1t2", [0, 1, 2], False)
        a.apply(delta(a, "!", [3]))
        stream._deliver(a)
        second = await anext(stream)
        stream._deliver(a)  # the same delta's hand-over, arriving after the reader has seen it: nothing to read
        a.apply(last := delta(a, "", [], True, "length", None, RequestMetrics(0.0)))
        stream._deliver(a.output(last))
        final = await anext(stream)
        assert first.token_ids == [0, 1, 2] and second.token_ids == final.token_ids == [0, 1, 2, 3]  # copies, not views
        assert not second.finished and (final.finished, final.finish_reason, final.text) == (True, "length", "t0t1t2!")
        with pytest.raises(StopAsyncIteration): await anext(stream)
        # a request that fails: its reader gets the output so far, running, and then the error
        stream, b = RequestStream("f", asyncio.get_running_loop()), OutputAssembly("f", "p", [1], 0.0)
        b.apply(delta(b, "x", [5]))
        stream._deliver(b)
        stream._deliver(RequestFailed("boom"))
        assert (await anext(stream)).token_ids == [5]
        with pytest.raises(RequestFailed, match="boom"): await anext(stream)
    asyncio.run(main())


def test_the_receiver_hands_over_assemblies_then_the_final_output_or_the_error():
    "EngineProcess._output without a child process: what each stream reads, what on_finished gets, what is forgotten."
    from nanoserve.async_engine import AsyncLLMEngine, hand_over
    client = EngineProcess.__new__(EngineProcess)  # the receiver's side only: no child process
    AsyncLLMEngine.__init__(client, None)
    client._assemblies, finished = {}, []
    client.on_finished.append(finished.append)
    async def main():
        loop = asyncio.get_running_loop()
        streams = {rid: RequestStream(rid, loop) for rid in ("ok", "failed", "stopped")}
        for rid, stream in streams.items():
            client._streams[rid], client._assemblies[rid] = stream, OutputAssembly(rid, "p", [1], 0.0)
        def step(*deltas):  # one message from the engine process: (request id, text, ids, finished, error tuple)
            items = []
            for rid, text, ids, done, error in deltas:
                a = client._assemblies[rid]
                client._output(items, OutputDelta(rid, len(a.text), text, ids, None, done, "stop" if done else None, None,
                                                  RequestMetrics(0.0) if done else None), error)
            hand_over(items)
        step(("ok", "a", [5], False, None), ("failed", "x", [7], False, None), ("stopped", "y", [8], False, None))
        step(("ok", "b", [6], True, None), ("failed", "", [], True, ("failed", "boom")),
             ("stopped", "", [], True, ("stopped", "shutting down")))
        await asyncio.sleep(0)  # the hand-overs land
        reads = {rid: [] for rid in streams}
        for rid, stream in streams.items():
            try:
                async for out in stream: reads[rid].append((out.text, out.token_ids, out.finished))
            except (RequestFailed, EngineStopped) as e: reads[rid].append(type(e).__name__)
        return reads
    reads = asyncio.run(main())
    assert reads["ok"] == [("ab", [5, 6], False), ("ab", [5, 6], True)]  # read late: all of it, running, then finished
    assert reads["failed"] == [("x", [7], False), "RequestFailed"] and reads["stopped"] == [("y", [8], False), "EngineStopped"]
    assert [(o.request_id, o.text, o.finished, o.finish_reason) for o in finished] == \
           [("ok", "ab", True, "stop"), ("failed", "x", True, "stop"), ("stopped", "y", True, "stop")]
    assert not client._assemblies and not client._streams


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_outputs_that_share_the_engines_lists_give_the_same_deltas(llm, async_scheduling):
    "The engine process takes each output's delta at once, so its engine does not copy token lists (snapshot_outputs=False)."
    engine = LLM(**OPTIONS, async_scheduling=True).llm_engine if async_scheduling else llm.llm_engine  # the GPU's way
    runs = []
    for snapshot in (True, False):
        engine.snapshot_outputs = snapshot
        try:
            for i, (prompt, params) in enumerate(zip(PROMPTS, PARAMS)): engine.add_request(f"{snapshot}-{i}", prompt, params)
            tracker, deltas = DeltaTracker(), []
            while engine.has_unfinished():
                for out in engine.step():
                    if not out.finished:  # shared (no copy) or a copy of its own
                        shared = out.token_ids is engine.requests[out.request_id].seq.output_token_ids
                        assert shared is not snapshot
                    d = tracker.delta(out)
                    deltas.append((out.request_id.split("-")[1], d.text_start, d.text, d.token_ids, d.logprobs,
                                   d.finished, d.finish_reason))
            runs.append(deltas)
        finally:
            engine.snapshot_outputs = True
    assert runs[0] == runs[1] and len(runs[0]) > len(PROMPTS)


def test_the_engine_process_takes_outputs_without_copies():
    "EngineLoop asks its engine for outputs that share the token lists (it turns each into a delta in the same pass)."
    from nanoserve.engine_process import EngineLoop
    class Engine: snapshot_outputs = True
    class Conn:
        def send_bytes(self, b): pass
    loop = EngineLoop(Engine(), Conn())
    assert loop.engine.snapshot_outputs is False
    loop.outgoing.put(None)
    loop.sender.join()


def test_the_engine_process_collects_less_often_while_it_runs():
    import gc
    from nanoserve.engine import ENGINE_GC_THRESHOLD
    from nanoserve.engine_process import EngineLoop
    class Engine: snapshot_outputs = True
    class Conn:
        def send_bytes(self, b): pass
    loop, seen = EngineLoop(Engine(), Conn()), []
    def gone():  # the client's end of the pipe closed: run returns quietly
        seen.append(gc.get_threshold()[0])
        raise EOFError
    loop.loop, before = gone, gc.get_threshold()
    loop.run()
    assert seen == [max(ENGINE_GC_THRESHOLD, before[0])] and gc.get_threshold() == before and not loop.sender.is_alive()


def test_output_delta_pickles_to_itself():
    "OutputDelta's own __reduce__ must carry every field (all set here to values that are not their defaults)."
    scored = PromptLogprobs([4, 5], 1)
    scored.fill(1, np.array([-2.5], np.float32), np.array([[9]]), np.array([[-0.25]], np.float32))
    d = OutputDelta("r", 3, "text", [1, 2], [TokenLogprobs(2, -0.5, [(2, -0.5), (7, -1.5)])], True, "stop", "boom",
                    RequestMetrics(1.0, 2.0, 3.0, 4.0, 1), 32, scored, "\n")
    assert pickle.loads(pickle.dumps(d)) == d


def test_outputs_equal_llm_generate(remote, llm):
    expected = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    async def main(): return await asyncio.gather(*(last_output(remote, p, q) for p, q in zip(PROMPTS, PARAMS)))
    for got, want in zip(asyncio.run(main()), expected):
        assert (got.text, got.token_ids, got.finish_reason, got.stop_reason, got.prompt_token_ids) == \
               (want.text, want.token_ids, want.finish_reason, want.stop_reason, want.prompt_token_ids)
        assert (got.logprobs is None) == (want.logprobs is None)
        if got.logprobs:
            assert [(lp.token_id, [t for t, _ in lp.top]) for lp in got.logprobs] == \
                   [(lp.token_id, [t for t, _ in lp.top]) for lp in want.logprobs]
        assert [None if lp is None else (lp.token_id, [t for t, _ in lp.top]) for lp in got.prompt_logprobs or []] == \
               [None if lp is None else (lp.token_id, [t for t, _ in lp.top]) for lp in want.prompt_logprobs or []]
        assert got.metrics.ttft is not None and got.metrics.e2e >= got.metrics.ttft
    assert expected[2].prompt_logprobs and expected[2].prompt_logprobs[1] is not None  # the case above is not empty


def test_each_message_reaches_the_event_loop_in_one_call(remote):
    "The receiver hands a message's outputs over together: a call per step and loop, not one per output."
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    async def main():
        loop, calls = asyncio.get_running_loop(), []
        def counted(*args, call=loop.call_soon_threadsafe):
            calls.append(args[0])
            return call(*args)
        loop.call_soon_threadsafe = counted
        steps = remote.stats.num_steps
        outs = await asyncio.gather(*(last_output(remote, p, params) for p in PROMPTS))
        return outs, len(calls), remote.stats.num_steps - steps
    outs, calls, steps = asyncio.run(main())
    assert all(len(out.token_ids) == 16 for out in outs)
    assert calls <= len(PROMPTS) + steps < 16 * len(PROMPTS)  # the verdicts, then at most one hand-over per step


def test_prompts_of_token_ids_are_not_sent_back(remote):
    "The verdict of a token-id prompt carries no ids: the client keeps its own, as a list."
    async def main(): return [await last_output(remote, p, SamplingParams(max_tokens=2)) for p in ([5, 6, 7], (5, 6, 7))]
    for out in asyncio.run(main()): assert out.prompt_token_ids == [5, 6, 7] and out.prompt is None


def test_abort_frees_blocks_in_the_engine_process(remote):
    async def main():
        gen = remote.generate(PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True))
        got = [await gen.__anext__() for _ in range(3)]
        await gen.aclose()  # aborts
        for _ in range(500):
            if remote.stats.kv_cache_usage == 0 and remote.stats.num_running == 0: break
            await asyncio.sleep(0.01)
        return got
    got = asyncio.run(main())
    assert len(got[-1].token_ids) < 200
    assert remote.stats.kv_cache_usage == 0 and remote.stats.num_running == 0


def test_refusals_and_overload(remote):
    assert (remote.max_model_len, remote.kv_capacity) == (256, 96 * 16)  # from the ready message: what the server checks against
    async def main():
        with pytest.raises(ValueError, match="max_model_len"): await remote.add_request([1] * 300, SamplingParams(max_tokens=4))
        remote.max_waiting = 1
        try:
            results = await asyncio.gather(*(remote.add_request(PROMPTS[0], SamplingParams(max_tokens=2)) for _ in range(5)),
                                           return_exceptions=True)
        finally: remote.max_waiting = None
        for r in results:
            if not isinstance(r, BaseException): [o async for o in remote.outputs(r)]
        return results
    results = asyncio.run(main())
    assert sum(isinstance(r, EngineOverloaded) for r in results) >= 1 and not all(isinstance(r, BaseException) for r in results)


def test_a_request_id_in_flight_is_refused_and_the_receiver_goes_on(remote):
    "Two adds of one id before the first verdict: the second verdict would find the first's entry, and the receiver would die."
    async def main():
        first = asyncio.ensure_future(remote.add_request(PROMPTS[0], SamplingParams(max_tokens=3), request_id="same"))
        await asyncio.sleep(0)  # the first add is sent, its verdict not back yet
        with pytest.raises(ValueError, match="request_id='same' is already running"):
            await remote.add_request(PROMPTS[1], SamplingParams(max_tokens=3), request_id="same")
        return [o async for o in remote.outputs(await first)][-1]
    assert len(asyncio.run(main()).token_ids) == 3 and remote.is_running


def test_signals_deferred_runs_the_handlers_after_the_block():
    from nanoserve.engine_process import signals_deferred
    got = []
    previous = signal.signal(signal.SIGUSR1, lambda sig, frame: got.append(sig))
    try:
        with signals_deferred(signal.SIGUSR1):
            os.kill(os.getpid(), signal.SIGUSR1)
            time.sleep(0.05)  # the handler would have run by now
            assert got == []
        assert got == [signal.SIGUSR1] and signal.getsignal(signal.SIGUSR1) is not None
    finally: signal.signal(signal.SIGUSR1, previous)


def test_an_engine_option_error_is_raised_by_the_constructor():
    with pytest.raises(ValueError, match="block_size"): EngineProcess(block_size=12, device="cpu")


def test_shutdown_finishes_short_requests_and_stops_long_ones():
    engine = EngineProcess(**{**OPTIONS, "max_model_len": 2048, "num_kv_blocks": 160}).start()  # room for a request that cannot finish
    async def main():
        short = asyncio.create_task(last_output(engine, PROMPTS[0], SamplingParams(max_tokens=4, ignore_eos=True)))
        long = asyncio.create_task(last_output(engine, PROMPTS[1], SamplingParams(max_tokens=2000, ignore_eos=True)))
        while engine.stats.num_running < 2: await asyncio.sleep(0.01)
        await asyncio.to_thread(engine.shutdown, 8.0)  # 4 tokens fit in 8 s even on a slow, busy CPU; 2000 do not
        return await asyncio.gather(short, long, return_exceptions=True)
    short, long = asyncio.run(main())
    assert short.finish_reason == "length" and len(short.token_ids) == 4
    assert isinstance(long, EngineStopped)
    assert engine.process.exitcode == 0 and not engine.is_running
    with pytest.raises(EngineStopped): asyncio.run(engine.add_request(PROMPTS[0]))


def test_a_killed_engine_process_fails_its_requests_and_stops_the_client():
    engine = EngineProcess(**OPTIONS).start()
    async def main():
        task = asyncio.create_task(last_output(engine, PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)))
        while engine.stats.num_running < 1: await asyncio.sleep(0.01)
        os.kill(engine.process.pid, signal.SIGKILL)
        with pytest.raises(RequestFailed, match="died"): await task
        with pytest.raises(EngineStopped): await engine.add_request(PROMPTS[0])
    asyncio.run(main())
    assert not engine.is_running and isinstance(engine.error, RequestFailed)
    engine.shutdown(1)


def test_shutdown_kills_an_engine_process_stuck_in_a_step():
    "A stopped child never reads the shutdown: it is killed exit_grace seconds past the deadline, which a second call brings forward."
    engine = EngineProcess(**OPTIONS).start()
    engine.exit_grace = 1.0
    async def main():
        task = asyncio.create_task(last_output(engine, PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)))
        while engine.stats.num_running < 1: await asyncio.sleep(0.01)
        os.kill(engine.process.pid, signal.SIGSTOP)  # as if stuck inside a step
        first = asyncio.create_task(asyncio.to_thread(engine.shutdown, 600))  # a first Ctrl-C: a long drain
        await asyncio.sleep(0.5)
        assert not first.done()
        start = time.monotonic()
        try:
            await asyncio.wait_for(asyncio.to_thread(engine.shutdown, 0), timeout=30)  # the second
            await asyncio.wait_for(first, timeout=5)
        finally:
            if engine.process.is_alive(): os.kill(engine.process.pid, signal.SIGKILL)  # no stopped child left behind
        assert time.monotonic() - start < 10
        with pytest.raises(RequestFailed, match="did not stop within 1 s of the shutdown deadline and was killed"): await task
    asyncio.run(main())
    assert engine.process.exitcode == -signal.SIGKILL and not engine.is_running and isinstance(engine.error, RequestFailed)


def test_the_server_runs_on_an_engine_process(llm):
    server = make_server(port=0, engine_process=True, log_level="warning", **OPTIONS)
    engine = server.config.app.state.server.engine
    expected = llm.generate([PROMPTS[0]], SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)[0]
    with run_in_thread(server) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=60)
        parts = list(client.completions.create(model=DEFAULT_MODEL, prompt=PROMPTS[0], max_tokens=12, temperature=0,
                                               stream=True, stream_options={"include_usage": True}))
        assert "".join(p.choices[0].text for p in parts if p.choices) == expected.text
        assert parts[-1].usage.completion_tokens == 12
        greedy = llm.generate(PROMPTS[:2], SamplingParams(temperature=0, max_tokens=6), use_tqdm=False)
        both = dict(model=DEFAULT_MODEL, prompt=PROMPTS[:2], n=2, max_tokens=6, temperature=0)
        assert [c.text for c in client.completions.create(**both).choices] == [o.text for o in greedy for _ in range(2)]
        texts = [""] * 4
        for part in client.completions.create(**both, stream=True):
            for c in part.choices: texts[c.index] += c.text
        assert texts == [o.text for o in greedy for _ in range(2)]
        os.kill(engine.process.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while not server.should_exit and time.monotonic() < deadline: time.sleep(0.05)
        assert server.should_exit and isinstance(engine.error, RequestFailed)  # a server with a dead engine stops


@pytest.mark.slow
def test_nanoserve_serve_exits_1_when_its_engine_process_dies(tmp_path):
    "An operator's view: kill the engine process of `nanoserve serve`; the server stops on its own, with status 1."
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "serve", "--port", str(port), "--device", "cpu",
                             "--max-model-len", "256", "--num-kv-blocks", "32"], stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200: break
            except httpx.HTTPError: pass
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "serve.log").read_text()
            time.sleep(0.1)
        pid = int(re.search(r"engine process (\d+):", (tmp_path / "serve.log").read_text()).group(1))
        os.kill(pid, signal.SIGKILL)
        assert proc.wait(timeout=60) == 1
    finally:
        if proc.poll() is None: proc.kill()
    assert "the engine has died" in (tmp_path / "serve.log").read_text()
