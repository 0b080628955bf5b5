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
  sphinx_jupyterbook_latex adds nodes and transforms that each change only their own document's tree.
An extension that declares itself unsafe keeps its word: Sphinx then warns and reads serially, and `-W` fails.

Parallel readers start kernels at the same moment, and jupyter_client picks each kernel's ports by asking the system
for free ones, which it then releases for the kernel to bind. Two kernels started together can be handed the same
port: the second to bind it dies ("Kernel died before replying to kernel_info"), and the book failed with it (CI,
2026-11-29). So every build here wraps nbclient's kernel start: on that error it starts a new kernel, with new ports.
"""
import functools, sys

import jupyter_book.cli.main
import jupyter_book.sphinx
import nbclient.client
import sphinx_jupyterbook_latex, sphinx_multitoc_numbering

KERNEL_START_ATTEMPTS = 3


def declared_parallel_safe(setup):
    "An extension's setup that declares it safe for parallel reading and writing, unless it declares otherwise."
    @functools.wraps(setup)
    def wrapped(app):
        return {"parallel_read_safe": True, "parallel_write_safe": True, **(setup(app) or {})}
    return wrapped


def kernel_start_retried(start_client, attempts: int = KERNEL_START_ATTEMPTS):
    """nbclient's NotebookClient.async_start_new_kernel_client, which on failure has already shut its kernel down,
    tried again with a new kernel manager and kernel (new ports) when the kernel died before it replied."""
    @functools.wraps(start_client)
    async def wrapped(self):
        for attempt in range(1, attempts + 1):
            try: return await start_client(self)
            except RuntimeError as e:
                if "died before replying" not in str(e) or attempt == attempts: raise
                print(f"build_book: a kernel died as it started ({e}); starting another, attempt {attempt + 1}", file=sys.stderr)
                self.kc, self.km = None, self.create_kernel_manager()
                await self.async_start_new_kernel()
    return wrapped


def parse_jobs(argv: list[str]) -> tuple:
    "(jobs, the rest of argv) from `--jobs N ...`; (None, argv) without `--jobs`."
    if argv[:1] != ["--jobs"]: return None, argv
    try: jobs = int(argv[1])
    except (IndexError, ValueError): jobs = 0
    if jobs < 1: sys.exit(f"--jobs {' '.join(argv[1:2]) or '(missing)'}: expected a positive integer")
    return jobs, argv[2:]


def run(argv: list[str]) -> None:
    jobs, argv = parse_jobs(argv)
    client = nbclient.client.NotebookClient
    if not hasattr(client.async_start_new_kernel_client, "__wrapped__"):
        client.async_start_new_kernel_client = kernel_start_retried(client.async_start_new_kernel_client)
    if jobs is not None:
        # jupyter-book's build command imports build_sphinx when it runs, so patching the module reaches it; a
        # version that binds it at import would silently build serially
        if "build_sphinx" in vars(jupyter_book.cli.main):
            raise RuntimeError("this jupyter-book binds build_sphinx at import, where --jobs cannot reach it")
        jupyter_book.sphinx.build_sphinx = functools.partial(jupyter_book.sphinx.build_sphinx, jobs=jobs)
        for extension in (sphinx_multitoc_numbering, sphinx_jupyterbook_latex):
            extension.setup = declared_parallel_safe(extension.setup)
    jupyter_book.cli.main.main(argv)


if __name__ == "__main__":
    run(sys.argv[1:])
