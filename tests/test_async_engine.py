"""Chapter 12a: the engine thread hands a step's outputs to each reader's event loop in one call, in order, and aborts a
request whose reader's loop has closed; so does chapter 12e's engine process."""
import asyncio, time

import pytest

from nanoserve import SamplingParams
from nanoserve.async_engine import AsyncLLMEngine, RequestStream, hand_over
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
