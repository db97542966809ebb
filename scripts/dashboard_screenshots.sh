#!/usr/bin/env bash
# Pictures for the README: the TensorBoard memory dashboard of the example run, and one snapshot's offline page.
#
#   bash scripts/dashboard_screenshots.sh            # from the repository root, in the environment with memcallbacks[lightning]
#
# Runs examples/lightning_cpu.py into a temporary folder, serves its logs with TensorBoard on
# 127.0.0.1 only, renders tests/data/cuda_like_snapshot.pickle with `memcallbacks render`, and
# screenshots both with headless Chromium (installed with apt-get when missing) into
#   docs/img/tensorboard_dashboard.png   docs/img/snapshot_page.png
# Chromium is driven over its DevTools protocol (scripts/chromium_shot.py, with websocket-client
# pip-installed into the temporary folder, not into your environment): it waits in real time until
# every CUSTOM SCALARS chart has drawn its lines, and writes nothing if that does not happen within
# 90 s or the page throws an error. Not part of CI. PYTHON=... picks the interpreter (default:
# python3); PORT=... the TensorBoard port.
set -euo pipefail

cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
PORT="${PORT:-6099}"
OUT_DIR="docs/img"
WORK="$(mktemp -d)"
TB_PID=""
cleanup() {
    if [ -n "$TB_PID" ]; then kill "$TB_PID" 2>/dev/null || true; wait "$TB_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

# headless Chromium: Debian/Ubuntu's package (named chromium-browser on some Ubuntu releases)
CHROMIUM="$(command -v chromium || command -v chromium-browser || true)"
if [ -z "$CHROMIUM" ]; then
    SUDO=""; [ "$(id -u)" -ne 0 ] && SUDO="sudo"
    $SUDO apt-get update -qq
    $SUDO apt-get install -y -qq chromium
    CHROMIUM="$(command -v chromium)"
fi
"$PYTHON" -c "import memcallbacks, lightning, tensorboard" 2>/dev/null || {
    echo "install the package first: pip install torch==2.13.0 && pip install -e '.[lightning]'" >&2; exit 1; }

# the DevTools client, into the temporary folder only
"$PYTHON" -m pip install --quiet --disable-pip-version-check --target "$WORK/pylib" websocket-client

shot() {  # shot URL OUTPUT.png WIDTH,HEIGHT tensorboard|page [CHARTS]
    PYTHONPATH="$WORK/pylib" "$PYTHON" scripts/chromium_shot.py "$1" "$2" --size "$3" --wait "$4" \
        --charts "${5:-1}" --timeout 90 --chromium "$CHROMIUM"
}

echo "== the example run"
"$PYTHON" examples/lightning_cpu.py --steps 60 --out "$WORK/runs" > "$WORK/example.log" 2>&1 || { cat "$WORK/example.log"; exit 1; }

echo "== TensorBoard on 127.0.0.1:$PORT"
"$PYTHON" -m tensorboard.main --logdir "$WORK/runs/example" --host 127.0.0.1 --port "$PORT" > "$WORK/tensorboard.log" 2>&1 &
TB_PID=$!
for _ in $(seq 1 60); do
    if "$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/data/plugins_listing', timeout=2)" 2>/dev/null; then break; fi
    sleep 1
done
"$PYTHON" -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/data/plugins_listing', timeout=2)" \
    || { cat "$WORK/tensorboard.log"; exit 1; }

mkdir -p "$OUT_DIR"
# smoothing off: a smoothed peak is not a peak
shot "http://127.0.0.1:$PORT/#custom_scalars&_smoothingWeight=0" "$OUT_DIR/tensorboard_dashboard.png" 1400,1000 tensorboard 3

echo "== one snapshot's offline page"
"$PYTHON" -m memcallbacks render tests/data/cuda_like_snapshot.pickle -o "$WORK/snapshot.html" > /dev/null
shot "file://$WORK/snapshot.html" "$OUT_DIR/snapshot_page.png" 1400,1000 page
