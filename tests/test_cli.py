import json, subprocess, sys

import pytest
from nanoserve.__main__ import main


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "nanoserve", *args], capture_output=True, text=True, timeout=300)


def test_prepare_default(capsys):
    assert main(["prepare"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "LlamaForCausalLM, 30 layers" in out


def test_prepare_bad_model_is_one_line_error_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["prepare", "/no/such/model/dir"])
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2
    assert err.startswith("nanoserve prepare: error: model='/no/such/model/dir'") and "\n" not in err


def test_python_dash_m_and_bad_flag_exit_code_2():
    run = run_cli("prepare", "--bogus")
    assert run.returncode == 2 and "unrecognized arguments: --bogus" in run.stderr
    run = run_cli("--version")
    assert run.returncode == 0 and run.stdout.startswith("nanoserve ")


def test_generate_chat_streams_paris_with_stats():
    run = run_cli("generate", "--chat", "--prompt", "What is the capital of France?", "--temperature", "0", "--show-stats")
    assert run.returncode == 0, run.stderr
    assert "Paris" in run.stdout
    assert "TTFT" in run.stderr and "TPOT" in run.stderr and "tokens/s" in run.stderr


def test_generate_greedy_equals_library_call():
    import torch
    from nanoserve.generate import generate
    from nanoserve.loader import load_model
    from nanoserve.sampling import SamplingParams
    from nanoserve.tokenizer import load_tokenizer
    tok = load_tokenizer()
    ids = tok.encode("The three primary colours are")
    want = generate(load_model(), tok, ids, SamplingParams(temperature=0, max_tokens=12)).text
    run = run_cli("generate", "--prompt", "The three primary colours are", "--temperature", "0", "--max-new-tokens", "12")
    assert run.returncode == 0 and run.stdout == want + "\n"


def test_generate_speculative_tokens_keep_the_greedy_output_and_report_acceptance():
    prompt = "Fix the spelling and write it out again: The quik brown fox jumpd over the lazzy dog."
    plain = run_cli("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "30")
    spec = run_cli("generate", "--chat", "--prompt", prompt, "--temperature", "0", "--max-new-tokens", "30",
                   "--speculative-tokens", "4", "--show-stats")
    assert plain.returncode == spec.returncode == 0, spec.stderr
    assert spec.stdout == plain.stdout and "tokens a pass" in spec.stderr and "draft tokens accepted" in spec.stderr


def test_generate_takes_the_shape_of_structured_output():
    run = run_cli("generate", "--chat", "--prompt", "Is Paris in France?", "--choice", "Yes", "--choice", "No", "--temperature", "0")
    assert run.returncode == 0 and run.stdout in ("Yes\n", "No\n"), run.stdout
    run = run_cli("generate", "--chat", "--prompt", "A person, as JSON.", "--temperature", "0", "--max-new-tokens", "60",
                  "--json-schema", '{"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}')
    assert run.returncode == 0 and isinstance(json.loads(run.stdout)["age"], int), run.stdout


def test_generate_starts_from_the_models_generation_config(tmp_path, capsys):
    "A sampling flag left out takes what generation_config.json recommends (or --override-generation-config sets); a flag wins."
    import json
    from nanoserve.generate import generate
    from nanoserve.loader import load_model, resolve_model
    from nanoserve.sampling import SamplingParams
    from nanoserve.tokenizer import load_tokenizer
    source, model = resolve_model(None), tmp_path / "model"
    model.mkdir()
    for f in source.iterdir():
        if f.name != "generation_config.json": (model / f.name).symlink_to(f)
    generation = json.loads((source / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(generation | {"temperature": 0.0, "max_new_tokens": 9}))
    tok, prompt = load_tokenizer(), "The three primary colours are"
    lm, ids = load_model(), tok.encode(prompt)
    def greedy(n): return generate(lm, tok, ids, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True)).text + "\n"
    def cli(*args):
        assert main(["generate", "--prompt", prompt, "--ignore-eos", *args]) == 0
        return capsys.readouterr().out
    assert cli("--model", str(model)) == greedy(9)  # the model's temperature 0 and max_new_tokens 9
    assert cli("--model", str(model), "--max-new-tokens", "4") == greedy(4)  # a flag over the model's value
    assert cli("--generation-config", "vllm", "--override-generation-config", '{"temperature": 0, "max_new_tokens": 3}',
               "--model", str(model)) == greedy(3)  # 'vllm': the override's fields alone
    assert cli("--model", str(model), "--override-generation-config", '{"max_new_tokens": 5}') == greedy(5)  # merged: still greedy
    config = json.loads((source / "config.json").read_text())
    (model / "config.json").unlink()
    (model / "config.json").write_text(json.dumps(config | {"max_position_embeddings": len(ids) + 4}))
    assert cli("--model", str(model)) == greedy(4)  # the model's 9 new tokens, cut to the 4 positions its context leaves
    with pytest.raises(SystemExit):
        cli("--model", str(model), "--min-tokens", "6")
    assert f"the prompt ({len(ids)} tokens) leaves 4 of the model's {len(ids) + 4} positions, and the completion needs at least 6" in capsys.readouterr().err


@pytest.mark.parametrize("args, message", [
    (["--prompt", "hi", "--temperature", "-1"], "temperature=-1.0"),
    (["--prompt", "hi", "--max-new-tokens", "0"], "max_tokens=0"),
    (["--prompt", "hi", "--top-k", "abc"], "invalid int value: 'abc'"),
    (["--prompt", "hi", "--device", "tpu"], "invalid choice: 'tpu'"),
    (["--prompt", "hi", "--model", "/no/such/dir"], "model='/no/such/dir'"),
    (["--temperature", "0"], "the following arguments are required: --prompt"),
    (["--prompt", "hi", "--override-generation-config", "[1]"], "expected a JSON object such as"),
    (["--prompt", "hi", "--override-generation-config", '{"max_tokens": 5}'], "override_generation_config={'max_tokens': 5}"),
    (["--prompt", "hi", "--override-generation-config", '{"top_p": 0}'], "override_generation_config: top_p=0"),
    (["--prompt", "hi", "--speculative-tokens", "-1"], "num_speculative_tokens=-1"),
    (["--prompt", "hi", "--regex", "(ab"], "unbalanced parenthesis"),
    (["--prompt", "hi", "--regex", "a+", "--choice", "a"], "not allowed with argument --regex"),
    (["--prompt", "hi", "--json-schema", "[1]"], "expected a JSON object such as"),
    (["--prompt", "hi", "--json-schema", '{"type": "number", "minimum": 3}'], "minimum on a number"),
    (["--prompt", "hi", "--regex", "a+", "--speculative-tokens", "2"], "structured_outputs"),
])
def test_generate_bad_arguments_exit_2_with_one_line(args, message):
    run = run_cli("generate", *args)
    assert run.returncode == 2, run.stderr
    assert message in run.stderr and "Traceback" not in run.stderr


@pytest.mark.parametrize("args, message", [
    (["prepare", "./no-such-dir"], "model='./no-such-dir' is neither a local directory"),  # once sent to the hub
    (["prepare", ""], "model='': expected a directory"),
    (["bench", "latency", "--input-len", "4", "--output-len", "3", "--batch-size", "4", "--max-num-seqs", "2"],
     "batch_size=4 is more than max_num_seqs=2"),
    (["bench", "throughput", "--input-len-range", "8", "4", "--output-len-range", "2", "4"], "input_len=(8, 4)"),
    (["bench", "latency", "--input-len", "8000", "--output-len", "500"], "the longest request needs 8500 positions"),
    (["bench", "latency", "--output-json", "."], "--output-json . is a directory"),
    (["bench", "serve", "--output-json", "/no/such/dir/x.json"], "the directory /no/such/dir does not exist"),
    (["serve", "--port", "0", "--api-key", ""], "api_key='': expected a non-empty string"),  # once: no authentication
    (["serve", "--port", "0", "--max-waiting", "0"], "max_waiting=0: expected None (no limit) or an integer >= 1"),
    (["serve", "--port", "70000"], "port=70000: expected 0 to 65535"),  # once an OverflowError from bind
    (["serve", "--port", "0", "--quantization", "int4"], "invalid choice: 'int4'"),
    (["serve", "--port", "0", "--override-generation-config", '{"temp": 0.5}'], "override_generation_config={'temp': 0.5}"),
    (["serve", "--port", "0", "--chat-template", "{% for %}"], "chat_template: line 1: Expected an expression"),
    (["serve", "--port", "0", "--chat-template", "./no-such-template.jinja"], "not a file, and not a template either"),
    (["serve", "--port", "0", "--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["serve", "--port", "0", "--tool-call-parser", "xml"], "invalid choice: 'xml'"),
    (["serve", "--port", "0", "--kv-cache-dtype", "int4"], "invalid choice: 'int4'"),
])
def test_bad_arguments_are_refused_before_any_work(args, message, capsys, monkeypatch):
    "Exit code 2 and one line naming the problem, before a model loads or a benchmark runs."
    import uvicorn  # a case that stops being refused would otherwise serve, and this test wait, forever (it once hung CI)
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, *a, **kw: pytest.fail(f"{args}: not refused, a server started"))
    with pytest.raises(SystemExit) as e:
        main(args)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and message in err and "KV cache" not in err, err
    assert err.splitlines()[-1].startswith("nanoserve " + " ".join(args[:2] if args[0] == "bench" else args[:1]) + ": error:")


def test_every_engine_option_has_a_flag():
    "Each EngineConfig field but the model has a flag whose default is the field's (chapter 9c's quantization too)."
    import dataclasses
    from nanoserve.__main__ import build_parser, engine_options
    from nanoserve.model_runner import EngineConfig
    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig) if f.name != "model"}
    assert engine_options(build_parser().parse_args(["serve"])) == fields
    options = engine_options(build_parser().parse_args(["serve", "--quantization", "int8"]))
    assert EngineConfig(**options).quantization == "int8"
    for flag, chunks in (("--enable-chunked-prefill", True), ("--no-enable-chunked-prefill", False)):  # None without either
        assert engine_options(build_parser().parse_args(["serve", flag]))["enable_chunked_prefill"] is chunks


def test_dtype_auto_is_accepted_as_in_vllm():
    from nanoserve.__main__ import build_parser, engine_options
    assert engine_options(build_parser().parse_args(["serve", "--dtype", "auto"]))["dtype"] == "auto"
    assert build_parser().parse_args(["generate", "--prompt", "hi", "--dtype", "auto"]).dtype == "auto"


@pytest.mark.slow
def test_ctrl_c_stops_generate_quietly():
    import signal, time
    # A shell's background job starts with SIGINT ignored, and Python then keeps it ignored: Ctrl-C's default, for the child
    proc = subprocess.Popen([sys.executable, "-m", "nanoserve", "generate", "--prompt", "Once upon a time", "--max-new-tokens", "2000",
                             "--ignore-eos", "--temperature", "0"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout.read(1)  # streaming: the model has loaded
        time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None: proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
