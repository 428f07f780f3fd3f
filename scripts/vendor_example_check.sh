#!/usr/bin/env bash
# The vendor path, end to end, with the example plugin (plugins/examples/halserve-plugin-example):
#   1. build its wheel; install it into a fresh venv (--system-site-packages: torch and halserve
#      come from the system Python, nothing is installed there);
#   2. `halserve plugins` lists it, with its layer override, model variant and communicator (plugin API 2);
#   3. `halserve conformance example` passes (the layers, communicator and variants checks included);
#   4. its own tests pass (pytest tests/);  5. `halserve serve --platform example <tiny checkpoint>` answers a
#      completion (then SIGTERM) and its log shows the plugin's ExampleRMSNorm and ExampleLlamaForCausalLM ran;
#   6. the new-vendor path: copy the folder, rename everything "example" -> "acme" with sed,
#      build, install, and `halserve conformance acme` passes.
# Usage: scripts/vendor_example_check.sh [--quick]     (--quick: trimmed conformance grids)
# Env: PYTHON (default python3), KEEP_TMP=1 keeps the work folder. Exit 0 when every step passed.
set -euo pipefail

QUICK=()
if [[ "${1:-}" == "--quick" ]]; then QUICK=(--quick); fi
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
EXAMPLE="$ROOT/plugins/examples/halserve-plugin-example"
PYTHON="${PYTHON:-python3}"
WORK="$(mktemp -d -t halserve-vendor-XXXXXX)"
SERVER_PID=""

cleanup() {
  if [[ -n "$SERVER_PID" ]] && kill -0 "$SERVER_PID" 2>/dev/null; then
    kill -TERM "$SERVER_PID" 2>/dev/null || true
    wait "$SERVER_PID" 2>/dev/null || true
  fi
  if [[ "${KEEP_TMP:-0}" != "1" ]]; then rm -rf "$WORK"; else echo "kept $WORK"; fi
}
trap cleanup EXIT

step() { echo; echo "==> $*"; }
fail() { echo "vendor_example_check: FAILED: $*" >&2; exit 1; }

# env without HALSERVE_* settings of the caller, so discovery sees exactly what is installed
for var in $(env | grep -o '^HALSERVE_[A-Z_]*' || true); do unset "$var"; done

build_and_install() {  # $1 = source folder, $2 = name for logs
  local src="$1" name="$2"
  rm -rf "$WORK/wheels-$name"
  # built by the system Python (its setuptools + wheel); installed into the venv only
  "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$WORK/wheels-$name" "$src" \
    || fail "building the $name wheel failed"
  "$VPY" -m pip install --quiet --no-deps --no-index "$WORK/wheels-$name"/*.whl \
    || fail "installing the $name wheel into the venv failed"
}

step "venv with system site packages in $WORK/venv"
"$PYTHON" -m venv --system-site-packages "$WORK/venv"
VPY="$WORK/venv/bin/python"
HALSERVE=("$VPY" -m halserve.entrypoints.cli)
"$VPY" -c "import halserve, torch" || fail "halserve and torch must be importable from the system Python"

step "build and install halserve-plugin-example"
cp -r "$EXAMPLE" "$WORK/example-src"
rm -rf "$WORK/example-src/build" "$WORK/example-src"/*.egg-info
build_and_install "$WORK/example-src" example
"$PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('halserve_plugin_example') is not None)" \
  || fail "halserve_plugin_example leaked into the system Python"

step "halserve plugins lists it"
"${HALSERVE[@]}" plugins > "$WORK/plugins.txt" || fail "halserve plugins exited non-zero"
grep -q "halserve-plugin-example" "$WORK/plugins.txt" || { cat "$WORK/plugins.txt"; fail "plugin not listed"; }
"${HALSERVE[@]}" plugins --json | "$VPY" -c '
import json, sys
report = json.load(sys.stdin)
plugin = [p for p in report["plugins"] if p["name"] == "example"]
assert plugin and plugin[0]["status"] == "loaded", plugin
assert any(p["name"] == "example" and p["available"] for p in report["platforms"]), report["platforms"]
print("plugin example:", plugin[0]["status"], plugin[0]["distribution"], plugin[0]["version"])
# plugin API 2: its layer override, model variant and communicator, scoped to platform example
(override,) = [r for r in report["layer_overrides"] if r["plugin"] == "example"]
assert (override["platform"], override["replaces"]) == ("example", "RMSNorm"), override
(variant,) = [v for v in report["model_variants"] if v["plugin"] == "example"]
assert (variant["platform"], variant["architecture"]) == ("example", "LlamaForCausalLM"), variant
(platform,) = [p for p in report["platforms"] if p["name"] == "example"]
assert platform["device_communicator"].endswith("ExamplePlatform.make_device_communicator"), platform
print("plugin example (API 2):", override["cls"], "for RMSNorm,", variant["target"], "for LlamaForCausalLM,",
      "its own communicator, all on platform example")
' || fail "halserve plugins --json does not show plugin/platform example as loaded and available, with its API 2 hooks"

step "halserve conformance example ${QUICK[*]}"
"${HALSERVE[@]}" conformance example "${QUICK[@]}" || fail "halserve conformance example did not pass"

step "the example's own tests (tests/test_conformance.py runs the kit)"
"$VPY" -m pytest -q -p no:cacheprovider "$WORK/example-src/tests" || fail "the example plugin's own tests failed"

step "halserve serve --platform example answers a completion"
"$VPY" -m halserve.plugins.testing.tiny_model "$WORK/tiny" > /dev/null
PORT="$("$VPY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"${HALSERVE[@]}" serve "$WORK/tiny" --platform example --host 127.0.0.1 --port "$PORT" \
  --max-model-len 128 --num-kv-blocks 64 > "$WORK/serve.log" 2>&1 &
SERVER_PID=$!
"$VPY" - "$PORT" "$SERVER_PID" <<'PY' || { tail -n 40 "$WORK/serve.log"; fail "the server did not answer a completion"; }
import json, os, sys, time, urllib.request
port, pid = sys.argv[1], int(sys.argv[2])
base = f"http://127.0.0.1:{port}"
deadline = time.time() + 240
while True:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        sys.exit("the server exited before it became healthy")
    try:
        with urllib.request.urlopen(base + "/health", timeout=2) as r:
            if r.status == 200:
                break
    except OSError:
        pass
    if time.time() > deadline:
        sys.exit("the server was not healthy within 240 s")
    time.sleep(0.5)
with urllib.request.urlopen(base + "/v1/models", timeout=30) as r:
    model = json.load(r)["data"][0]["id"]
body = json.dumps({"model": model, "prompt": "hello", "max_tokens": 5, "temperature": 0}).encode()
req = urllib.request.Request(base + "/v1/completions", body, {"Content-Type": "application/json"})
with urllib.request.urlopen(req, timeout=120) as r:
    data = json.load(r)
choice = data["choices"][0]
assert data["usage"]["completion_tokens"] == 5, data
print(f"completion from platform example: {choice['text']!r} ({data['usage']})")
PY
kill -TERM "$SERVER_PID"
wait "$SERVER_PID" || true  # a SIGTERM'd server may exit non-zero; it must exit, which wait ensures
SERVER_PID=""
# the completion ran the plugin's own layer and model (each logs once in the engine's process)
grep -m1 "ExampleRMSNorm: first forward" "$WORK/serve.log" | sed 's/^/override used: /' | grep . \
  || { tail -n 40 "$WORK/serve.log"; fail "the server's log does not show the plugin's ExampleRMSNorm running"; }
grep -q "ExampleLlamaForCausalLM: built for platform example" "$WORK/serve.log" \
  || { tail -n 40 "$WORK/serve.log"; fail "the server did not build the plugin's ExampleLlamaForCausalLM"; }

step "new vendor path: copy, rename example -> acme, install, run the kit"
cp -r "$EXAMPLE" "$WORK/halserve-plugin-acme"
rm -rf "$WORK/halserve-plugin-acme/build" "$WORK/halserve-plugin-acme"/*.egg-info
(
  cd "$WORK/halserve-plugin-acme"
  mv halserve_plugin_example halserve_plugin_acme
  grep -rl example . | xargs sed -i 's/example/acme/g; s/Example/Acme/g'
)
grep -rqi example "$WORK/halserve-plugin-acme" && fail "the rename left 'example' behind"
build_and_install "$WORK/halserve-plugin-acme" acme
"${HALSERVE[@]}" plugins | grep -q "halserve-plugin-acme" || fail "halserve plugins does not list halserve-plugin-acme"
"${HALSERVE[@]}" conformance acme "${QUICK[@]}" || fail "halserve conformance acme did not pass"

echo
echo "vendor_example_check: OK (example: listed, conformance passed, served a completion; acme: renamed copy passed)"
