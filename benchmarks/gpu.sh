#!/usr/bin/env bash
# One-call GPU benchmark: runs benchmarks/run.py on the machine's GPU and writes the JSON.
#
#   bash benchmarks/gpu.sh [OUT_DIR]        (default: $OUT if set, else ./bench-gpu)
#
# Writes OUT_DIR/bench_gpu.json (all records, merged), OUT_DIR/bench_<stage>.json and OUT_DIR/bench_gpu.log. Designed for a machine WITHOUT internet access (the project's
# H200 device machine): it uses the python3 whose jax already has a CUDA backend
# (that image ships jax + jax-cuda plugin, flax, optax, orbax, scipy, matplotlib, tqdm).
# Nothing is downloaded. If a package is missing it is installed from wheels in
# $CCPO_WHEELS (default: ./.whl, e.g. prepared with `pip download --no-deps -d .whl tensorboardX`)
# when present; tensorboardX alone may be missing: run.py then replaces it with a
# no-op writer for the reproduce timing and says so in the JSON config.
# Stages have their own timeouts so the whole script stays under 10 minutes (run.py rewrites
# its JSON after every record, so a stage stopped by its timeout keeps what it measured):
#   1. env + eval  (full sizes, 1 .. 65,536 episodes; 1 .. 1,000 splits)          <= 105 s
#   2. train (full: 300 iterations, 1 split; retrain 10 and 100 splits, 100 it)     <= 120 s
#   3. reproduce (full: 100 splits, the default iterations)                          <= 120 s
#   4. devices (quick: forced CPU host devices N = 1, 2, on the CPU cores)           <= 75 s
#   5. sweep (quick: trainer member-it/s at 20 and 200 members and at 80 members as one vmap vs
#      retrain's blocks, the 4-alpha sweep vs 4 reproduce runs at 20 splits x 20 iterations,
#      the retrain protocol at 10 splits; the --devices all runs only on a multi-core CPU) <= 150 s
#   then benchmarks/perf.py (quick) <= 240 s, and
#   gymnax (quick: benchmarks/gymnax_throughput.py, random-policy steps/s through gymnax's API at
#      1, 64, 1,024, 4,096 envs beside gymnax's CartPole-v1, and the wrapper's cost over the raw
#      env; only when gymnax imports, e.g. from the wheel cache below)                       <= 45 s
# Files: OUT_DIR/bench_gpu.json (merged), bench_<stage>.json, bench_gpu.log (9 files).
set -u
cd "$(dirname "$0")/.."
REPO=$(pwd)
OUT_DIR=${1:-${OUT:-$REPO/bench-gpu}}
mkdir -p "$OUT_DIR"
export PYTHONPATH="$REPO${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
export XLA_PYTHON_CLIENT_PREALLOCATE=false

# Pick a python whose jax sees a GPU: $PYTHON, python3, /opt/torch/.venv/bin/python3, ./venv.
PY=""
for cand in ${PYTHON:-} python3 /opt/torch/.venv/bin/python3 "$REPO/../venv/bin/python" python; do
  command -v "$cand" >/dev/null 2>&1 || continue
  if "$cand" -c "import jax, sys; sys.exit(0 if jax.default_backend() == 'gpu' else 1)" >/dev/null 2>&1; then
    PY=$cand; break
  fi
done
if [ -z "$PY" ]; then
  echo "gpu.sh: no python with a CUDA-enabled jax found (tried \$PYTHON, python3, /opt/torch/.venv/bin/python3)." >&2
  echo "        On a machine with internet: pip install -U 'jax[cuda12]' flax optax orbax-checkpoint chex tqdm scipy matplotlib" >&2
  exit 2
fi
echo "gpu.sh: using $PY ($($PY -c 'import jax; print("jax", jax.__version__, jax.devices())'))"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null | sed 's/^/gpu.sh: /'

# Missing packages: install from a local wheel cache if one is there (no network).
WHEELS=${CCPO_WHEELS:-$REPO/.whl}
missing=$("$PY" - <<'EOF'
import importlib.util
need = ["flax", "optax", "orbax.checkpoint", "chex", "tqdm", "scipy", "matplotlib", "yaml", "tensorboardX", "gymnax"]
print(" ".join(n for n in need if importlib.util.find_spec(n) is None))
EOF
)
if [ -n "$missing" ]; then
  echo "gpu.sh: missing python packages: $missing"
  if ls "$WHEELS"/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/ccpo-site "$WHEELS"/*.whl \
      && export PYTHONPATH="$PYTHONPATH:/tmp/ccpo-site" && echo "gpu.sh: installed wheels from $WHEELS"
  else
    echo "gpu.sh: no wheel cache at $WHEELS; continuing (tensorboardX is optional for the benchmark)"
  fi
fi

LOG="$OUT_DIR/bench_gpu.log"
: > "$LOG"
stage() {  # name timeout args...   (run.py saves its JSON after every section)
  local name=$1 limit=$2; shift 2
  echo "gpu.sh: stage $name (limit ${limit}s)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 "$limit" "$PY" benchmarks/run.py "$@" --out "$OUT_DIR/bench_$name.json" \
    >> "$LOG" 2>&1
  local rc=$?
  [ $rc -eq 0 ] || echo "gpu.sh: stage $name exited with $rc (see $LOG)" | tee -a "$LOG"
}

t0=$(date +%s)
stage env_eval 105 --only env,eval
stage train 120 --only train
stage reproduce 120 --only reproduce
stage devices 75 --quick --only devices --device-counts 1,2
stage sweep 150 --quick --only sweep
echo "gpu.sh: stage perf (limit 240s)" | tee -a "$LOG"  # benchmarks/perf.py: reproduce 1st/2nd, gateway, CPO vs torch
timeout --signal=TERM --kill-after=10 240 "$PY" benchmarks/perf.py --quick --out "$OUT_DIR/bench_perf.json" >> "$LOG" 2>&1 \
  || echo "gpu.sh: stage perf exited with $? (see $LOG)" | tee -a "$LOG"
if "$PY" -c "import gymnax" >/dev/null 2>&1; then
  echo "gpu.sh: stage gymnax (limit 45s)" | tee -a "$LOG"
  timeout --signal=TERM --kill-after=10 45 "$PY" benchmarks/gymnax_throughput.py --quick \
    --out "$OUT_DIR/bench_gymnax.json" >> "$LOG" 2>&1 || echo "gpu.sh: stage gymnax exited with $? (see $LOG)" | tee -a "$LOG"
else
  echo "gpu.sh: stage gymnax skipped: gymnax is not importable (pip install gymnax, or its wheels in \$CCPO_WHEELS)" | tee -a "$LOG"
fi
grep -A12 "^summary" "$LOG"

"$PY" - "$OUT_DIR" <<'EOF'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
recs = []
for name in ("env_eval", "train", "reproduce", "devices", "sweep", "perf", "gymnax"):
    p = out / f"bench_{name}.json"
    if p.exists():
        for r in json.loads(p.read_text()):
            r.setdefault("config", {})["stage"] = name
            recs.append(r)
tmp = out / ".bench_gpu.json.tmp"
tmp.write_text(json.dumps(recs, indent=2) + "\n")
tmp.replace(out / "bench_gpu.json")
print(f"gpu.sh: wrote {len(recs)} records to {out / 'bench_gpu.json'}")
EOF
echo "gpu.sh: total $(( $(date +%s) - t0 )) s"
