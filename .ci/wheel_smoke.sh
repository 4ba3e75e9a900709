#!/usr/bin/env bash
# The package as a user installs it: build the wheel, install it with the documented extras into a fresh venv,
# then `mfs --version`, `mfs --help`, a missing extra's one-line error, and one request through `mfs serve`.
set -euo pipefail
cd "$(dirname "$0")/.."
work=$(mktemp -d)
trap 'kill "${server:-0}" 2>/dev/null || true; rm -rf "$work"' EXIT
python3 -m pip wheel -q --no-deps -w "$work/dist" .
python3 -m venv "$work/venv"
py="$work/venv/bin/python"
"$py" -m pip install -q --upgrade pip
"$py" -m pip install -q torch==2.13.0
wheel=$(ls "$work"/dist/mfs-*.whl)
"$py" -m pip install -q "${wheel}[fleet,sim]"
cd "$work"                                   # nothing from the source tree on the path
"$work/venv/bin/mfs" --version
"$work/venv/bin/mfs" --help >/dev/null
if "$work/venv/bin/mfs" dashboard 2>"$work/dashboard.err"; then
  echo "wheel smoke: mfs dashboard ran without the dashboard extra" >&2; exit 1
fi
grep -q "pip install 'mfs\[dashboard\]'" "$work/dashboard.err" || { cat "$work/dashboard.err" >&2; exit 1; }
port=$("$py" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
"$work/venv/bin/mfs" serve --port "$port" >"$work/serve.log" 2>&1 &
server=$!
"$py" - "$port" <<'PY'
import json, sys, time, urllib.request
base = f"http://127.0.0.1:{sys.argv[1]}"
deadline = time.time() + 180
while True:
    try:
        urllib.request.urlopen(base + "/health", timeout=2)
        break
    except OSError:
        if time.time() > deadline:
            sys.exit("wheel smoke: mfs serve did not become healthy in 180 s")
        time.sleep(1)
body = json.dumps({"model": "tiny", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 8,
                   "temperature": 0}).encode()
request = urllib.request.Request(base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"})
reply = json.load(urllib.request.urlopen(request, timeout=120))
assert reply["choices"][0]["message"]["content"] and reply["usage"]["completion_tokens"] > 0, reply
print(f"wheel smoke: mfs serve answered with {reply['usage']['completion_tokens']} tokens from {reply['model']}")
PY
echo "wheel smoke: passed"
