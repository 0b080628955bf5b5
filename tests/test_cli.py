import subprocess, sys

from nanoserve.__main__ import main


def test_prepare_default(capsys):
    assert main(["prepare"]) == 0
    out = capsys.readouterr().out
    assert "SmolLM2-135M-Instruct" in out and "LlamaForCausalLM, 30 layers" in out


def test_prepare_bad_model_is_one_line_error(capsys):
    assert main(["prepare", "/no/such/model/dir"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("nanoserve prepare: error: model='/no/such/model/dir'") and "\n" not in err


def test_python_dash_m_and_bad_flag_exit_code_2():
    run = subprocess.run([sys.executable, "-m", "nanoserve", "prepare", "--bogus"], capture_output=True, text=True)
    assert run.returncode == 2 and "unrecognized arguments: --bogus" in run.stderr
    run = subprocess.run([sys.executable, "-m", "nanoserve", "--version"], capture_output=True, text=True)
    assert run.returncode == 0 and run.stdout.startswith("nanoserve ")
