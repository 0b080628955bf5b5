"""`jupyter-book build`, with Sphinx reading (and so executing) the chapters in parallel processes.

    python _ext/build_book.py --jobs 2 build -W --keep-going .

Every argument after `--jobs N` goes to `jupyter-book` unchanged; `make book` runs this.

Reading a notebook is where myst-nb executes it, so N jobs execute up to N chapters at once. Two things stand
in the way, and this file moves both:
- jupyter-book 1.x's command line has no `--jobs`, though its build function takes `jobs` and passes it to
  Sphinx as `parallel`;
- Sphinx reads serially when any extension does not declare itself safe for it, and two that jupyter-book loads
  declare nothing. Both are safe: sphinx_multitoc_numbering (sphinx_external_toc always loads it) only replaces
  the method that numbers sections, which runs in the main process after every document is read and merged;
  sphinx_jupyterbook_latex adds nodes and per-document transforms that act in LaTeX builds and keep no state.
"""
import functools, sys

import jupyter_book.sphinx
import sphinx_jupyterbook_latex, sphinx_multitoc_numbering
from jupyter_book.cli.main import main


def declared_parallel_safe(setup):
    "An extension's setup that also declares the extension safe for parallel reading and writing."
    @functools.wraps(setup)
    def wrapped(app):
        return {**(setup(app) or {}), "parallel_read_safe": True, "parallel_write_safe": True}
    return wrapped


def run(argv: list[str]) -> None:
    if argv[:1] == ["--jobs"]:
        if len(argv) < 2 or not argv[1].isdigit() or int(argv[1]) < 1:
            sys.exit(f"--jobs {' '.join(argv[1:2])}: expected a positive integer")
        jobs, argv = int(argv[1]), argv[2:]
        for extension in (sphinx_multitoc_numbering, sphinx_jupyterbook_latex):
            extension.setup = declared_parallel_safe(extension.setup)
        # jupyter_book.cli.main imports build_sphinx inside its build command: patching the module reaches it
        jupyter_book.sphinx.build_sphinx = functools.partial(jupyter_book.sphinx.build_sphinx, jobs=jobs)
    main(argv)


if __name__ == "__main__":
    run(sys.argv[1:])
