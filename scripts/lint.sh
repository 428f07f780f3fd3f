#!/usr/bin/env bash
# Lint: ruff over the whole tree, then mypy over the typed packages. Exits non-zero on any error.
#
#   bash scripts/lint.sh            both
#   bash scripts/lint.sh ruff|mypy  one of them
#
# mypy needs the import names (halserve.executors, ...), but the root folders are mapped to them
# by setup.py's ROOTS through setuptools' editable finder, which mypy cannot follow. So mypy runs
# on a tree of symlinks, build/mypy/halserve/..., made from ROOTS (reported paths read
# build/mypy/halserve/<pkg>/<file>.py = <root folder>/<file>.py).
set -uo pipefail
cd "$(dirname "$0")/.."

# what mypy checks (pyproject.toml [tool.mypy] holds the settings)
# (core/, the halserve package itself, is added module by module: `-p halserve` would take every subpackage)
MYPY_TARGETS=(
    -p halserve.plugins
    -p halserve.executors
    -m halserve.platforms.base
    -m halserve.attention_backends.base
)

run_ruff() {
    echo "== ruff check ."
    ruff check .
}

build_mypy_tree() {
    python - <<'PY'
import ast, os, shutil

here = os.getcwd()
tree = ast.parse(open("setup.py", encoding="utf-8").read())
roots = next(ast.literal_eval(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROOTS" for t in node.targets))
out = os.path.join(here, "build", "mypy")
shutil.rmtree(out, ignore_errors=True)
for folder, name in sorted(roots.items(), key=lambda kv: kv[1].count(".")):
    dest = os.path.join(out, *name.split("."))
    os.makedirs(dest, exist_ok=True)
    for entry in os.listdir(os.path.join(here, folder)):
        if entry == "__pycache__" or os.path.exists(os.path.join(dest, entry)):
            continue
        os.symlink(os.path.join(here, folder, entry), os.path.join(dest, entry))
PY
}

run_mypy() {
    echo "== mypy core/ (halserve) ${MYPY_TARGETS[*]}"
    build_mypy_tree || return 1
    local core
    core=$(for f in core/*.py; do m=$(basename "$f" .py); [ "$m" = __init__ ] && echo "-m halserve" || echo "-m halserve.$m"; done
           for d in core/*/; do [ -f "$d/__init__.py" ] && echo "-p halserve.$(basename "$d")"; done)
    # shellcheck disable=SC2086
    MYPYPATH=build/mypy mypy $core "${MYPY_TARGETS[@]}" | sed -e "$(python - <<'PY'
# build/mypy/halserve/<pkg>/x.py -> <root folder>/x.py, the longest import name first
import ast
tree = ast.parse(open("setup.py", encoding="utf-8").read())
roots = next(ast.literal_eval(node.value) for node in ast.walk(tree)
             if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "ROOTS" for t in node.targets))
for folder, name in sorted(roots.items(), key=lambda kv: -kv[1].count(".")):
    print(f"s|^build/mypy/{name.replace('.', '/')}/|{folder}/|;")
PY
)"
    return "${PIPESTATUS[0]}"
}

status=0
case "${1:-all}" in
    ruff) run_ruff || status=1 ;;
    mypy) run_mypy || status=1 ;;
    all) run_ruff || status=1; run_mypy || status=1 ;;
    *) echo "usage: $0 [ruff|mypy]" >&2; exit 2 ;;
esac
exit $status
