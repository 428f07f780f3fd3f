"""Every repository path the documentation names exists.

Scans README.md, CONTRIBUTING.md, BENCHMARKS.md, docs/*.md and the docstrings of the
package's modules (every ``.py`` under setup.py's ROOTS folders) for path-like tokens and
fails listing each one that names nothing in the checkout, with where it was found.

What counts as a path (so prose is not mistaken for one):

* a token that starts with a top-level folder of the repository (a ROOTS folder such as
  ``core/`` or ``platforms/``, or ``tests/``, ``benchmarks/``, ``scripts/``, ``docs/``,
  ``.ci/``) or with ``halserve/`` (the import name is never a folder of the checkout:
  ``halserve/plugins/hookspecs.py`` is ``plugins/hookspecs.py``), and is either quoted in
  backticks (``core/kv_cache``) or, in running text, ends with ``/`` or a file extension
  (core/scheduler.py, platforms/cpu_kernels/) -- so prose such as "kernels/attention" is not
  taken for a path;
* a markdown link target that is not a URL or an anchor, resolved from the file's folder.

A path exists if it names a file or folder from the repository root or from the document's
own folder (an example plugin's README names its own files), or names a module without its
``.py``. A ``<placeholder>`` part ends the checked prefix (``tests/<dir>`` checks ``tests/``);
``*`` globs must match something; ``{a,b}`` alternatives are each checked; a trailing
``:123``, ``::test_name`` or ``#anchor`` is dropped. Paths in fenced code blocks are checked
too, except inside blocks that show another project's files (a vendor plugin's
``pyproject.toml``), which name no path of this checkout.
"""
from __future__ import annotations

import ast
import glob
import re
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def _roots() -> list[str]:
    """setup.py's ROOTS folders, read without running setup.py."""
    tree = ast.parse((REPO / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "ROOTS" for t in node.targets):
            return list(ast.literal_eval(node.value))
    raise AssertionError("setup.py defines no ROOTS mapping")


ROOTS = _roots()
# top-level folders a documented path may start with; "halserve" never exists (see above)
TOP = sorted({*ROOTS, "tests", "benchmarks", "scripts", "docs", ".ci", "halserve"}, key=len, reverse=True)
_TOP_RE = "|".join(re.escape(t) for t in TOP)
# a path token: not preceded by a path character (so "a/core/x", "foo.core/" and "$HOME/tests" are not)
PATH_RE = re.compile(r"(?<![\w./\-~$])(?:\./)?((?:" + _TOP_RE + r")/[\w./*<>{},\-]*)")
LINK_RE = re.compile(r"\]\(([^)\s]+)\)")
SKIP_DIRS = {".git", "build", "dist", "__pycache__", "node_modules"}


def doc_files() -> list[Path]:
    """README.md, CONTRIBUTING.md, BENCHMARKS.md, docs/*.md and every other tracked-looking .md."""
    return sorted(
        p for p in REPO.rglob("*.md")
        if not SKIP_DIRS.intersection(p.relative_to(REPO).parts) and not p.parent.name.endswith(".egg-info")
    )


def package_docstrings() -> list[tuple[str, int, str]]:
    """(file, line, docstring) for every module, class and function docstring in ROOTS and scripts/."""
    out = []
    for root in [*ROOTS, "scripts"]:
        for path in sorted((REPO / root).rglob("*.py")):
            if SKIP_DIRS.intersection(path.parts):
                continue
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                    doc = ast.get_docstring(node, clean=False)
                    if doc:
                        line = node.body[0].lineno if node.body else 1
                        out.append((str(path.relative_to(REPO)), line, doc))
    return out


def path_tokens(text: str) -> list[str]:
    """The path-like tokens of ``text`` (rules in the module docstring)."""
    tokens = []
    for m in PATH_RE.finditer(text):
        token = m.group(1)
        quoted = m.start() > 0 and text[m.start() - 1] == "`" and text[m.end():m.end() + 1] == "`"
        bare = re.sub(r"(::|#|:\d).*$", "", token).rstrip(".,;:")
        if quoted or bare.endswith("/") or re.search(r"\.[A-Za-z]\w*$", bare.rsplit("/", 1)[-1]):
            tokens.append(token)
    return tokens


def _expand(token: str) -> list[str]:
    """``{a,b}`` alternatives -> one token each."""
    m = re.search(r"\{([^{}]*)\}", token)
    if not m:
        return [token]
    return [x for alt in m.group(1).split(",") for x in _expand(token[: m.start()] + alt + token[m.end():])]


def _exists(target: Path) -> bool:
    if "*" in str(target):
        return bool(glob.glob(str(target), recursive=True))
    return target.exists() or target.with_name(target.name + ".py").exists()


def path_exists(token: str, base: Path = REPO) -> bool:
    """Whether ``token`` names something from the repository root or from ``base``."""
    token = re.split(r"::|#|:\d", token, maxsplit=1)[0].rstrip(".,;:)")
    if token.endswith("..."):
        token = token[:-3]
    if "<" in token:  # a placeholder: check the folder before it
        token = token.split("<", 1)[0]
        token = token[: token.rfind("/") + 1]
    alts = _expand(token)
    if not token or any(a.startswith("halserve/") for a in alts):
        return False
    return all(any(_exists(b / a) for b in {REPO, base}) for a in alts)


def _foreign_blocks(text: str) -> str:
    """The text with fenced blocks that show another project's files blanked out (lines kept)."""

    def blank(m: re.Match) -> str:
        body = m.group(0)
        first = body.split("\n", 2)[1] if body.count("\n") >= 2 else ""
        if re.match(r"#\s*(pyproject\.toml|\S+\.py) of ", first) or re.match(r"#\s*halserve_\w+/", first):
            return "\n" * body.count("\n")
        return body

    return re.sub(r"```.*?```", blank, text, flags=re.S)


def stale_paths() -> list[str]:
    problems = []
    for path in doc_files():
        rel = path.relative_to(REPO)
        text = _foreign_blocks(path.read_text())
        for lineno, line in enumerate(text.splitlines(), 1):
            for token in path_tokens(line):
                if not path_exists(token, base=path.parent):
                    problems.append(f"{rel}:{lineno}: {token}")
            for target in LINK_RE.findall(line):
                if re.match(r"[a-z][a-z0-9+.-]*:|#", target):
                    continue
                if not path_exists(target.split("#", 1)[0], base=path.parent) or target.startswith("/"):
                    problems.append(f"{rel}:{lineno}: link ({target})")
    for rel, line, doc in package_docstrings():
        for token in path_tokens(doc):
            if not path_exists(token, base=(REPO / rel).parent):
                problems.append(f"{rel}:{line} (docstring): {token}")
    return problems


def test_path_rules():
    assert path_tokens("see `halserve/plugins/hookspecs.py` and core/scheduler.py.") == [
        "halserve/plugins/hookspecs.py",
        "core/scheduler.py.",
    ]
    assert not path_exists("halserve/plugins/hookspecs.py")
    assert path_exists("plugins/hookspecs.py")
    assert path_exists("core/scheduler.py.")
    assert not path_exists("core/models/llama.py")
    assert path_exists("models/llama.py")
    assert path_exists("tests/<dir>/test_x.py")
    assert path_exists("platforms/{cpu,cuda}.py") and not path_exists("platforms/{cpu,nope}.py")
    assert path_exists("core/kv_cache/*.py") and not path_exists("core/nope/*.py")
    assert path_exists("tests/test_packaging.py::test_wheel_holds_every_subpackage")
    assert path_exists("platforms/cpu_kernels/shm_comm")  # a module named without .py
    # backticked, a trailing slash or an extension make a path; prose does not
    assert path_tokens("`core/kv_cache` and kernels/ and tests/core/x.py") == ["core/kv_cache", "kernels/", "tests/core/x.py"]
    assert path_tokens("resolve kernels/attention, tokens/s, a/core/b.py, vendor.core/x, $HOME/tests/x") == []


def test_documented_paths_exist():
    problems = stale_paths()
    assert not problems, "the documentation names paths that do not exist:\n" + "\n".join(problems)
