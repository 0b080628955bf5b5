"""Sphinx extension: render nbdev notebooks as a reader should see them.

nbdev steers a notebook with `#| ...` lines at the top of code cells. jupyter-book knows nothing of
them, so on `source-read` (before myst-nb parses and executes the notebook) each directive is turned
into the cell tag jupyter-book understands and the `#|` lines are removed from the source:

| nbdev directive                       | effect in the book                              |
|---------------------------------------|-------------------------------------------------|
| `default_exp`, `hide`                 | cell removed (it still runs, unless skipped)     |
| `eval: false`, a test flag (gpu, ...) | cell shown, never executed (`skip-execution`)    |
| `echo: false`                         | input removed, output kept                      |
| `output: false`                       | output removed                                  |
| `code-fold: true`                     | input folded into a dropdown (exercise solutions) |
| `export`, `exporti`, `exports`, ...   | nothing: the code is the lesson                 |
"""
import configparser, json, re
from pathlib import Path

DIRECTIVE = re.compile(r"^\s*#\s*\|\s*(?P<name>[\w-]+)\s*:?\s*(?P<value>.*?)\s*$")
REMOVE_CELL = {"default_exp", "hide"}


def skip_flags(srcdir) -> set:
    "The flags (`tst_flags` in settings.ini) that mark cells nbdev_test skips, plus `notest`."
    cfg = configparser.ConfigParser()
    cfg.read(Path(srcdir) / "settings.ini")
    return set(cfg.get("DEFAULT", "tst_flags", fallback="").split()) | {"notest"}


def split_directives(source: str):
    "Split a code cell into its nbdev directives (name -> value) and the remaining source."
    directives, body = {}, []
    for line in source.splitlines(keepends=True):
        m = DIRECTIVE.match(line)
        if m is None:
            body.append(line)
            continue
        directives[m["name"]] = m["value"]
    return directives, "".join(body).strip("\n")


def tags_for(directives: dict, flags: set) -> set:
    "The jupyter-book tags that stand for a cell's nbdev directives."
    tags = set()
    if REMOVE_CELL & directives.keys():
        tags.add("remove-cell")
    if directives.get("eval", "").lower() == "false" or flags & directives.keys():
        tags.add("skip-execution")
    if directives.get("echo", "").lower() == "false":
        tags.add("remove-input")
    if directives.get("output", "").lower() == "false":
        tags.add("remove-output")
    if directives.get("code-fold", "").lower() == "true":
        tags.add("hide-input")
    return tags


def translate_notebook(nb: dict, flags: set) -> dict:
    "Turn every code cell's nbdev directives into tags and drop cells left empty."
    cells = []
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "code":
            source = cell["source"] if isinstance(cell["source"], str) else "".join(cell["source"])
            directives, body = split_directives(source)
            if directives and not body:
                continue  # a cell of directives only, e.g. `#| default_exp norm`
            cell["source"] = body
            meta = cell.setdefault("metadata", {})
            meta["tags"] = sorted(set(meta.get("tags", [])) | tags_for(directives, flags))
        cells.append(cell)
    nb["cells"] = cells
    return nb


def on_source_read(app, docname, source):
    if not str(app.env.doc2path(docname)).endswith(".ipynb"):
        return
    nb = translate_notebook(json.loads(source[0]), skip_flags(app.srcdir))
    source[0] = json.dumps(nb)


def setup(app):
    app.connect("source-read", on_source_read)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
