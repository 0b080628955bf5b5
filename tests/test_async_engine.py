"""Chapter 12a: the engine thread hands a step's outputs to each reader's event loop in one call, in order, without
copying their token lists, and aborts a request whose reader's loop has closed; so does chapter 12e's engine process."""
import asyncio, time

import pytest

from nanoserve import LLM, SamplingParams
from nanoserve.async_engine import AsyncLLMEngine, RequestStream, SharedOutput, hand_over
from nanoserve.engine import RequestMetrics, RequestOutput, TokenLogprobs
from nanoserve.engine_process import EngineProcess


def test_hand_over_makes_one_call_per_loop_in_order_and_names_closed_loops():
    loops, calls = [asyncio.new_event_loop() for _ in range(2)], []
    for loop in loops:
        def counted(*args, loop=loop, call=loop.call_soon_threadsafe):
            calls.append(loop)
            return call(*args)
        loop.call_soon_threadsafe = counted
    closed = asyncio.new_event_loop()
    closed.close()
    streams = [RequestStream(f"r{i}", loops[i % 2]) for i in range(4)] + [RequestStream("gone", closed)]
    items = [(s, RuntimeError(f"{s.request_id}:{k}")) for k in range(3) for s in streams]  # errors are queued, never replaced
    assert hand_over(items) == {"gone"}
    assert sorted(map(id, calls)) == sorted(map(id, loops))  # one call per live loop
    for loop in loops:
        loop.run_until_complete(asyncio.sleep(0))  # runs the delivery
        loop.close()
    for s in streams[:4]: assert [str(e) for e in s.pending] == [f"{s.request_id}:{k}" for k in range(3)]
    assert not streams[4].pending


def test_a_shared_output_is_cut_to_the_tokens_of_its_step():
    ids, logprobs = [5, 6], [TokenLogprobs(5, -0.1, {}), TokenLogprobs(6, -0.2, {})]
    shared = SharedOutput(RequestOutput("r", "p", [1], "ab", ids, False, None, RequestMetrics(0.0), logprobs))
    ids.append(7); logprobs.append(TokenLogprobs(7, -0.3, {}))  # the engine's next step
    out = shared.unread()
    assert out.token_ids == [5, 6] and [lp.token_id for lp in out.logprobs] == [5, 6] and out.text == "ab"
    assert out.token_ids is not ids  # the reader's own copy


def test_a_thread_engine_streams_prefixes_of_its_final_output_without_copies_per_step():
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    prompts = ["The capital of France is", "Once upon a time"]
    expected = LLM(max_model_len=256, num_kv_blocks=64, device="cpu").generate(prompts, params, use_tqdm=False)
    engine = AsyncLLMEngine.from_options(max_model_len=256, num_kv_blocks=64, device="cpu").start()
    assert engine.engine.snapshot_outputs is False
    async def read(prompt, slow):
        outs = []
        async for out in engine.generate(prompt, params):
            outs.append(out)
            if slow: await asyncio.sleep(0.05)  # steps go by: this reader gets SharedOutputs made some steps late
        return outs
    async def main(): return await asyncio.gather(read(prompts[0], False), read(prompts[1], True))
    try: streams = asyncio.run(main())
    finally: engine.shutdown(5)
    for outs, want in zip(streams, expected):
        final = outs[-1]
        assert final.finished and final.token_ids == want.token_ids and final.text == want.text
        assert [lp.token_id for lp in final.logprobs] == want.token_ids
        sizes = [len(out.token_ids) for out in outs]
        assert sizes == sorted(set(sizes)) and len(outs) > 2  # each output newer than the last, none repeated
        for out in outs:
            assert out.token_ids == final.token_ids[:len(out.token_ids)] and len(out.logprobs) == len(out.token_ids)


def test_shutdown_gives_up_on_an_engine_thread_stuck_in_a_step():
    "A thread cannot be killed: exit_grace seconds past the deadline, shutdown returns anyway and says why."
    import threading
    engine = AsyncLLMEngine.from_options(max_model_len=256, num_kv_blocks=64, device="cpu")
    engine.exit_grace, stuck, release = 0.5, threading.Event(), threading.Event()
    step = engine.engine.step
    def hung(): stuck.set(); release.wait(60); return step()
    engine.engine.step = hung
    engine.start()
    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(engine.add_request("Once upon a time", SamplingParams(max_tokens=4)))
        assert stuck.wait(30)
        start = time.monotonic()
        engine.shutdown(0.2)
        assert time.monotonic() - start < 5 and engine._thread.is_alive()
        assert "did not stop within 0.5 s of the shutdown deadline" in str(engine.error) and not engine.is_running
    finally:
        release.set()
        engine._thread.join(30)
        loop.close()


@pytest.mark.parametrize("kind", [AsyncLLMEngine, EngineProcess])
def test_a_request_whose_reader_loop_closed_is_aborted(kind):
    engine = kind.from_options(max_model_len=256, num_kv_blocks=64, device="cpu").start()
    finished = []
    engine.on_finished.append(finished.append)
    try:
        loop = asyncio.new_event_loop()
        loop.run_until_complete(engine.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True)))
        loop.close()  # the reader is gone without a word: the next hand-over fails, and the request is aborted
        deadline = time.monotonic() + 60
        while not finished and time.monotonic() < deadline: time.sleep(0.01)
    finally: engine.shutdown(5)
    assert [out.finish_reason for out in finished] == ["abort"] and len(finished[0].token_ids) < 200


@pytest.mark.parametrize("kind", [AsyncLLMEngine, EngineProcess])
def test_abort_takes_an_iterable_of_ids_as_the_engine_does(kind):
    "Once str(['a', 'b']) was looked up, and nothing aborted."
    engine = kind.from_options(max_model_len=256, num_kv_blocks=64, device="cpu").start()
    finished = []
    engine.on_finished.append(finished.append)
    loop = asyncio.new_event_loop()
    try:
        for request_id in ("a", "b", 7):
            loop.run_until_complete(engine.add_request("Once upon a time", SamplingParams(max_tokens=200, ignore_eos=True), request_id))
        with pytest.raises(ValueError, match="request_id=None"): engine.abort(None)
        engine.abort(["a", "b"])
        engine.abort(7)
        deadline = time.monotonic() + 60
        while len(finished) < 3 and time.monotonic() < deadline: time.sleep(0.01)
    finally:
        engine.shutdown(5)
        loop.close()
    assert sorted((out.request_id, out.finish_reason) for out in finished) == [("7", "abort"), ("a", "abort"), ("b", "abort")]


@pytest.mark.parametrize("kind", [AsyncLLMEngine, EngineProcess])
def test_a_second_shutdown_can_end_the_drain_but_never_extend_it(kind):
    "What a server's second Ctrl-C does: shutdown(0) during a long drain aborts what still runs, now."
    import threading
    from nanoserve.async_engine import EngineStopped, drain_deadline
    soon = time.monotonic() + 1
    assert drain_deadline(soon, 60) == soon and drain_deadline(soon, 0) < soon and drain_deadline(None, 5) > soon
    engine = kind.from_options(max_model_len=2048, num_kv_blocks=160, device="cpu").start()
    loop = asyncio.new_event_loop()
    try:
        stream = loop.run_until_complete(engine.add_request("Once upon a time", SamplingParams(max_tokens=2000, ignore_eos=True)))
        draining = threading.Thread(target=engine.shutdown, args=(120,))
        draining.start()
        time.sleep(0.5)
        assert draining.is_alive()  # 2000 tokens are still being made: the drain has something to cut short
        start = time.monotonic()
        engine.shutdown(0)
        draining.join(60)
        assert not draining.is_alive() and time.monotonic() - start < 30  # not the 120 s drain
        async def read():
            async for _ in stream: pass
        with pytest.raises(EngineStopped):
            loop.run_until_complete(read())
    finally:
        engine.shutdown(0)
        loop.close()
