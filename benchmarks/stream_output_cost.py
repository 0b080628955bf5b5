"""Host time the engine process spends per streaming request per step turning the engine's output into a delta.

Chapter 12e's loop calls `Request.output()` for every streaming request after every step and hands the result to
`DeltaTracker.delta`. With `snapshot=True` (chapter 11b's default) the output carries a copy of the request's whole
token list, so the cost grows with the tokens generated so far; with `snapshot=False` (what `EngineLoop` asks for) it
shares the list and only the delta is copied. This times both, with the request's token list and text grown by one
token (four characters) per step, as a running request's are. It also times the server's side of the pipe,
chapter 12e's `OutputAssembly`: `apply`, which adds each delta to the request's lists, and `output`, which makes a
RequestOutput of them (a copy of the token list) when a stream's reader takes one. Until 2026-11-24 `apply` did both
for every delta (`results/stream_output_cost_cpu_cb70b54.json` timed that). No model and no GPU: the engine's own
objects only.

    python benchmarks/stream_output_cost.py --out stream_output_cost.json

Prints one JSON object: microseconds per request per step, by output length and mode.
"""
import argparse, datetime, json, os, platform, sys, time, timeit
from pathlib import Path

try:
    import nanoserve  # noqa: F401
except ImportError:  # not installed: run from the checkout
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from nanoserve.engine import Request, RequestMetrics
from nanoserve.engine_process import DeltaTracker, OutputAssembly, OutputDelta
from nanoserve.sampling import SamplingParams
from nanoserve.scheduler import Sequence

LENGTHS = (128, 1024, 4096, 16384)  # output tokens generated so far
STEPS, REPEATS = 100, 15  # steps timed per repeat (each repeat starts afresh), repeats whose median is reported


def median_us(step, reset) -> float:
    "Microseconds per call of `step`: the median over REPEATS of STEPS calls, `reset` before each repeat."
    times = sorted(timeit.repeat(step, setup=reset, number=STEPS, repeat=REPEATS))
    return round(times[REPEATS // 2] / STEPS * 1e6, 2)


def us_per_step(num_tokens: int, snapshot: bool) -> float:
    "Microseconds one engine step costs a streaming request (a new token, then output() and its delta), num_tokens in."
    state = {}

    def reset():  # each repeat starts num_tokens in, with that much already sent
        seq = Sequence("r", list(range(100)), SamplingParams(max_tokens=num_tokens + STEPS + 1))
        seq.output_token_ids = list(range(num_tokens))
        state["seq"], state["tracker"] = seq, DeltaTracker()
        state["req"] = Request(seq, "prompt", None, None, RequestMetrics(time.monotonic()), text="abcd" * num_tokens)
        state["tracker"].delta(state["req"].output())

    def step():
        seq, req = state["seq"], state["req"]
        seq.output_token_ids.append(7)
        req.text = req.text + "abcd"  # as the engine does: the tracker holds the old text, so this copies it
        state["tracker"].delta(req.output(snapshot))
    return median_us(step, reset)


def us_per_assembly_call(num_tokens: int, read: bool) -> float:
    "The server's side of the pipe, num_tokens in: OutputAssembly.apply of one token's delta, or (read) its output()."
    state = {}

    def reset():
        state["a"] = a = OutputAssembly("r", "prompt", list(range(100)), 0.0)
        a.token_ids, a.text = list(range(num_tokens)), "abcd" * num_tokens

    def step():
        a = state["a"]
        if read: state["out"] = a.output()  # the one before is freed here, as a reader drops the output it sent
        else: a.apply(OutputDelta("r", len(a.text), "abcd", [7], None, False, None, None, None))
    return median_us(step, reset)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    rows = [{"output_tokens": n, "us_snapshot": us_per_step(n, True), "us_shared": us_per_step(n, False),
             "us_server_apply": us_per_assembly_call(n, read=False), "us_server_read": us_per_assembly_call(n, read=True)}
            for n in LENGTHS]
    res = {"benchmark": "stream_output_cost", "machine": f"{platform.processor() or platform.machine()}, "
           f"{os.cpu_count()} CPUs, Python {platform.python_version()}",
           "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "unit": "microseconds per streaming request per engine step", "rows": rows}
    text = json.dumps(res, indent=1)
    if args.out: args.out.write_text(text + "\n")
    print(text)


if __name__ == "__main__":
    main()
