"The book's notebook reader extension (nbdev directives become jupyter-book tags and never show) and its parallel build."
import re, sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parents[1] / "_ext"))
from nbdev_directives import skip_flags, split_directives, tags_for, translate_notebook  # noqa: E402

FLAGS = {"notest", "gpu", "slow"}


def code(source, tags=()):
    return {"cell_type": "code", "source": source, "metadata": {"tags": list(tags)}, "outputs": []}


def test_directives_parsed_in_all_spellings():
    d, body = split_directives("#| export\n#|eval:false\n#| default_exp norm\n# a comment\nx = 1\n")
    assert d == {"export": "", "eval": "false", "default_exp": "norm"}
    assert body == "# a comment\nx = 1"


def test_tags():
    assert tags_for({"hide": ""}, FLAGS) == {"remove-cell"}
    assert tags_for({"eval": "false"}, FLAGS) == {"skip-execution"}
    assert tags_for({"gpu": ""}, FLAGS) == {"skip-execution"}
    assert tags_for({"echo": "false"}, FLAGS) == {"remove-input"}
    assert tags_for({"output": "false"}, FLAGS) == {"remove-output"}
    assert tags_for({"code-fold": "true"}, FLAGS) == {"hide-input"}
    assert tags_for({"export": ""}, FLAGS) == set()


def test_translate_notebook_strips_every_directive():
    nb = {"cells": [code("#| default_exp norm"), code("#| export\nimport torch"),
                    code("#| slow\nbig()", ["keep-me"]), {"cell_type": "markdown", "source": "#| not code", "metadata": {}}]}
    out = translate_notebook(nb, FLAGS)["cells"]
    assert len(out) == 3  # the directive-only cell is gone
    assert out[0]["source"] == "import torch" and out[0]["metadata"]["tags"] == []
    assert out[1]["source"] == "big()" and out[1]["metadata"]["tags"] == ["keep-me", "skip-execution"]
    assert out[2]["source"] == "#| not code"  # markdown is left alone


def test_flags_read_from_settings():
    assert {"gpu", "slow", "notest"} <= skip_flags(Path(__file__).parents[1])


def test_every_chapter_translates_without_visible_directives():
    import json
    for nb_path in sorted((Path(__file__).parents[1] / "chapters").glob("*.ipynb")):
        nb = translate_notebook(json.loads(nb_path.read_text()), FLAGS)
        for cell in nb["cells"]:
            if cell["cell_type"] == "code":
                assert not any(line.lstrip().startswith("#|") for line in cell["source"].splitlines()), nb_path.name


def test_build_book_declares_extensions_parallel_safe_unless_they_say_otherwise():
    from build_book import declared_parallel_safe
    setup = declared_parallel_safe(lambda app: {"version": "1.2", "env_version": 3})
    assert setup(None) == {"version": "1.2", "parallel_read_safe": True, "parallel_write_safe": True, "env_version": 3}
    assert declared_parallel_safe(lambda app: None)(None) == {"parallel_read_safe": True, "parallel_write_safe": True}
    assert declared_parallel_safe(lambda app: {"parallel_read_safe": False})(None)["parallel_read_safe"] is False


def test_build_book_passes_jobs_to_sphinx_and_the_rest_to_jupyter_book(monkeypatch):
    import build_book, jupyter_book.cli.main, jupyter_book.sphinx, nbclient.client, sphinx_jupyterbook_latex, sphinx_multitoc_numbering
    originals = {module: module.setup for module in (sphinx_multitoc_numbering, sphinx_jupyterbook_latex)}
    for module, name in ((jupyter_book.sphinx, "build_sphinx"), *((m, "setup") for m in originals),
                         (nbclient.client.NotebookClient, "async_start_new_kernel_client")):
        monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
    calls = []
    monkeypatch.setattr(jupyter_book.cli.main, "main", calls.append)
    build_book.run(["--jobs", "3", "build", "-W", "--keep-going", "."])
    assert calls == [["build", "-W", "--keep-going", "."]]
    assert jupyter_book.sphinx.build_sphinx.keywords == {"jobs": 3}
    assert "build_sphinx" not in vars(jupyter_book.cli.main)  # imported when the command runs: the patch reaches it
    for module, setup in originals.items():  # wrapped, not called: their setup patches Sphinx itself
        assert module.setup.__wrapped__ is setup
    build_book.run(["build", "."])  # without --jobs: jupyter-book as it is
    assert calls[-1] == ["build", "."]


@pytest.mark.parametrize("jobs, shown", [([], "(missing)"), (["0"], "0"), (["two"], "two"), (["-1"], "-1"), (["²"], "²")])
def test_build_book_refuses_a_bad_jobs_count(monkeypatch, jobs, shown):
    import build_book, jupyter_book.cli.main
    monkeypatch.setattr(jupyter_book.cli.main, "main", lambda argv: pytest.fail("built with a bad --jobs"))
    with pytest.raises(SystemExit, match=f"^--jobs {re.escape(shown)}: expected a positive integer$"):
        build_book.run(["--jobs", *jobs])


class FakeClient:
    "Just enough of nbclient's NotebookClient for kernel_start_retried: kernels that die as they start, `deaths` times."
    def __init__(self, deaths, error="Kernel died before replying to kernel_info"):
        self.deaths, self.error, self.kc, self.km, self.kernels = deaths, error, None, None, 0
    async def start_client(self):
        if self.deaths:
            self.deaths -= 1
            raise RuntimeError(self.error)
        self.kc = "client"
        return self.kc
    def create_kernel_manager(self): return "manager"
    async def async_start_new_kernel(self): self.kernels += 1


def test_build_book_starts_another_kernel_when_one_dies_as_it_starts(capsys):
    import asyncio
    from build_book import kernel_start_retried
    start = kernel_start_retried(FakeClient.start_client, attempts=3)
    client = FakeClient(deaths=2)  # two kernels lost their port to a neighbour's, the third starts
    assert asyncio.run(start(client)) == "client" and client.kernels == 2 and client.km == "manager"
    assert capsys.readouterr().err.count("a kernel died as it started") == 2
    with pytest.raises(RuntimeError, match="died before replying"): asyncio.run(start(FakeClient(deaths=3)))  # gives up
    other = FakeClient(deaths=1, error="No kernel is running!")  # any other failure is not retried
    with pytest.raises(RuntimeError, match="No kernel is running"): asyncio.run(start(other))
    assert other.kernels == 0


def test_build_book_wraps_nbclients_kernel_start_once(monkeypatch):
    import inspect, build_book, jupyter_book.cli.main, nbclient.client
    original = inspect.unwrap(nbclient.client.NotebookClient.async_start_new_kernel_client)
    monkeypatch.setattr(nbclient.client.NotebookClient, "async_start_new_kernel_client", original)  # restored after the test
    monkeypatch.setattr(jupyter_book.cli.main, "main", lambda argv: None)
    build_book.run(["build", "."])
    build_book.run(["build", "."])
    assert nbclient.client.NotebookClient.async_start_new_kernel_client.__wrapped__ is original


def test_build_book_survives_a_kernel_that_loses_its_port(monkeypatch, tmp_path):
    """The race itself, with a real kernel: the first kernel is given a port that another process holds, as a kernel
    started at the same moment by the other reader would, and dies; the wrapped client starts another and executes."""
    import socket
    import jupyter_client.connect, nbformat, nbclient.client
    from build_book import kernel_start_retried
    client = nbclient.client.NotebookClient
    monkeypatch.setattr(client, "async_start_new_kernel_client", kernel_start_retried(client.async_start_new_kernel_client))
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    asked, find = [], jupyter_client.connect.LocalPortCache.find_available_port
    def first_port_taken(self, ip):
        asked.append(ip)
        return held.getsockname()[1] if len(asked) == 1 else find(self, ip)
    monkeypatch.setattr(jupyter_client.connect.LocalPortCache, "find_available_port", first_port_taken)
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell("print(6 * 7)")])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    try:
        ran = client(nb, resources={"metadata": {"path": str(tmp_path)}}, startup_timeout=60).execute()
    finally:
        held.close()
    assert ran.cells[0].outputs[0]["text"] == "42\n" and len(asked) > 4  # a second kernel, with ports of its own
