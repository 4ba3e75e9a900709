#!/usr/bin/env bash
# The package as a user installs it: build the wheel, then in fresh venvs
#   - the newcomer's base path: ONLY `pip install torch==2.13.0` and the wheel (no extras), then one chat request
#     through `mfs serve`;
#   - the wheel with the documented extras [fleet,sim]: `mfs --version`, `mfs --help`, a missing extra's one-line
#     error, and one request through `mfs serve`.
# torch: this CI machine cannot reach PyTorch's CPU index and takes the CPU wheel from local disk; elsewhere set
# TORCH_INDEX=https://download.pytorch.org/whl/cpu (as `make install` takes it), or PyPI gives the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
server=
trap '[ -n "$server" ] && kill "$server" 2>/dev/null; rm -rf "$work"' EXIT
python3 -m pip wheel -q --no-deps -w "$work/dist" .
wheel=$(ls "$work"/dist/mfs_serve-*.whl)
torch_index=()
[ -z "${TORCH_INDEX:-}" ] || torch_index=(--index-url "$TORCH_INDEX")

serve_and_ask() {   # $1: a venv. `mfs serve` from it, run outside the source tree, answers one chat request.
  local venv=$1 port
  port=$("$venv/bin/python" -c \
    'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
  (cd "$work" && exec "$venv/bin/mfs" serve --port "$port") >"$venv.serve.log" 2>&1 &
  server=$!
  if ! "$venv/bin/python" - "$port" "$server" <<'PY'
import json, os, sys, time, urllib.request
base, pid = f"http://127.0.0.1:{sys.argv[1]}", int(sys.argv[2])
deadline = time.time() + 180
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        if time.time() > deadline:
            sys.exit("wheel smoke: mfs serve did not become healthy in 180 s")
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            sys.exit("wheel smoke: mfs serve exited before it became healthy")
        time.sleep(1)
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] > 0, reply
print(f"wheel smoke: mfs serve answered with {reply['usage']['completion_tokens']} tokens from {reply['model']}")
PY
  then
    cat "$venv.serve.log" >&2
    exit 1
  fi
  kill "$server"
  wait "$server" || true
  server=
}

# The newcomer's base path, exactly as README and docs/getting-started.md say (pip's cache makes torch quick).
started=$SECONDS
python3 -m venv "$work/base"
"$work/base/bin/python" -m pip install -q torch==2.13.0 "${torch_index[@]}"
"$work/base/bin/python" -m pip install -q "$wheel"
serve_and_ask "$work/base"
echo "wheel smoke: the base install (torch + the wheel, no extras) serves ($((SECONDS - started)) s)"

python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0 "${torch_index[@]}"
"$py" -m pip install -q "${wheel}[fleet,sim]"
cd "$work"                                   # nothing from the source tree on the path
version=$("$work/venv/bin/mfs" --version)
echo "$version"
case $version in
  *unknown*) echo "wheel smoke: mfs --version does not find the installed distribution" >&2; exit 1;;
esac
"$work/venv/bin/mfs" --help >/dev/null
if "$work/venv/bin/mfs" dashboard 2>"$work/dashboard.err"; then
  echo "wheel smoke: mfs dashboard ran without the dashboard extra" >&2; exit 1
fi
grep -q "pip install 'mfs-serve\[dashboard\]'" "$work/dashboard.err" || { cat "$work/dashboard.err" >&2; exit 1; }
serve_and_ask "$work/venv"
echo "wheel smoke: passed"
