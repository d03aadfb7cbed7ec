#!/usr/bin/env bash
# On the GPU machine: every cuda-marked test, the judge's CUDA cases, then the GPU
# benchmarks, in one call. Runs from the repository root without installing anything
# (torch, safetensors, transformers and pytest are already there).
#   bash scripts/gpu_check.sh          tests + judge + benchmarks at ~0.6B / ~1.7B
#   bash scripts/gpu_check.sh tests    tests and the judge only (no benchmarks)
#   bash scripts/gpu_check.sh large    the ~8B decode and update benchmarks only
#   bash scripts/gpu_check.sh two-gpu  (two GPUs) the NCCL teardown probe, tests/test_tp.py and tests/test_two_gpus.py, then the NCCL trainer -> engine broadcast
#                                      against a raw NCCL broadcast at ~1.7B and ~8B (exit 3 with fewer GPUs)
#   bash scripts/gpu_check.sh broadcast  (one GPU) the NCCL teardown probe, then the broadcast benchmark at ~1.7B over
#                                      gloo from host memory, three rounds: the engine's own phases per bucket
#   bash scripts/gpu_check.sh update   every CUDA test, then every update path at ~1.7B (bench update)
#   bash scripts/gpu_check.sh update-large  every update path at ~8B
#   bash scripts/gpu_check.sh large-hot  the ~8B restart-vs-hot benchmark and the disk reader sweep
#                                      (each "large" call stays under ten minutes)
#   bash scripts/gpu_check.sh kernels  the registered copy settings compared at ~1.7B and ~8B
#   bash scripts/gpu_check.sh profile  torch.profiler tables: a first token and in-process updates at ~8B
#   bash scripts/gpu_check.sh serve-load  64 streaming clients through updates every 2 s for 5 min at ~1.7B, 512 MB buckets (FastAPI wheels: scripts/server_wheels.sh)
#   bash scripts/gpu_check.sh serve-baseline  the same 64 clients at ~1.7B with no updates, BASELINE_S (75) s, traced:
#                                      each long gap and slow first token explained (about 3 minutes in all)
#   bash scripts/gpu_check.sh verify   every CUDA test, then judge.py check on the chapters and problems that have CUDA
#                                      cases (CHAPTERS to choose; about 5 minutes): an engine change, checked in one call
#   bash scripts/gpu_check.sh serve-one-call  the load test with each update in one call (/sync_weights) at ~1.7B:
#                                      BASELINE_S (30) s without, DURATION_S (40) s with an update every 2 s (about 3 minutes)
#   bash scripts/gpu_check.sh serving  every CUDA test, ~8B decode (profiled), first token and
#                                      hot update (hot-vs-cold), in-process updates
#   bash scripts/gpu_check.sh mutate   judge.py mutate: every mutant (cosmic-ray's operators and the judge's) of
#                                      every region of one group of chapters per call, GROUP=1..6 (each estimated
#                                      at 4 to 6 minutes, printed first), or CHAPTERS="ch03 ch05"; neither: every
#                                      group, one after another (about 30 minutes); PER_REGION=n draws n per region
#   bash scripts/gpu_check.sh buckets  the bucket fast path's CUDA tests and the bucket-vs-registered update bench
#   bash scripts/gpu_check.sh speed    the speed tier (chapters 03-05) for the reference, and for a slow correct commit step
#   bash scripts/gpu_check.sh judge    judge.py check on every chapter and problem (references pass, stubs and wrong
#                                      answers fail, CUDA cases graded), then REPEAT= runs of each GPU race case alone
#                                      (scripts/race_repeat.py; RACE_BUDGET_S bounds it)
# Packages the GPU machine lacks (FastAPI for chapter 07, hypothesis for the differential
# cases) are installed from .whl/ when it is there (scripts/server_wheels.sh fills it).
# Logs and JSON go to $OUT (or gpu-latest/); copy them into results/<machine>-<date>/.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${OUT:-gpu-latest}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)" | tee -a "$out/gpu.txt"
status=0
if [ -d .whl ] && ! python -c "import hypothesis, fastapi, cosmic_ray, parso, attrs" 2>/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile .whl/*.whl 2>&1 | tail -1
fi
if [ "${1:-}" = "speed" ]; then
    python practice/judge.py speed --json > "$out/speed_reference.json" || status=1
    python practice/judge.py speed ch04 --file practice/hidden/chapters/ch04/slow/copy_in_place.sync_each.py --json \
        > "$out/speed_slow_ch04.json" || status=1
    python -c "import json; [print(r['exercise'], r['status'], r.get('vs_reference'), r.get('vs_copy'), r.get('learner_gbps'), r.get('why', '')) for f in ['$out/speed_reference.json', '$out/speed_slow_ch04.json'] for r in json.load(open(f))]"
    exit $status
fi
if [ "${1:-}" = "buckets" ]; then
    python -m pytest -m cuda -p no:cacheprovider -q -rA tests/test_bucket_fastpath.py tests/test_registered.py \
        tests/test_cuda_updates.py 2>&1 | tee "$out/pytest_cuda_buckets.log" || status=1
    python -m course_lib.bench update --preset qwen3-1.7b --bucket-mb 512 --parts ipc registered \
        --json "$out/update_buckets_qwen3-1.7b.json" 2>&1 | grep -v "it/s]" | tee "$out/update_buckets_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "judge" ]; then
    python practice/judge.py check --jobs "${JOBS:-10}" $(ls practice/chapters | grep '^ch[0-9][0-9]$') \
        $(ls practice/problems | grep -v -x bucket-handoff) 2>&1 | tee "$out/judge_check.log" || status=1
    python practice/judge.py check bucket-handoff 2>&1 | tee "$out/judge_check_bucket_handoff.log" || status=1
    if [ "${REPEAT:-0}" -gt 0 ]; then  # the cases that race a GPU stream, each alone: the same verdict every run?
        python scripts/race_repeat.py --repeat "$REPEAT" --budget-s "${RACE_BUDGET_S:-420}" 2>&1 \
            | tee "$out/race_repeat.log" || status=1
    fi
    exit $status
fi
if [ "${1:-}" = "mutate" ]; then
    # Groups sized from the mutant counts and the seconds one graded mutant's run took on the
    # H200 (results/h200-2026-12-02/mutate.jsonl, median per region; below, per chapter), with
    # 15% more for mutants that run until their time limit: each group under 9 minutes.
    groups=("ch00 ch01 ch04" "ch02 ch06" "ch03 ch08" "ch05" "ch07" "ch09")
    if [ -n "${CHAPTERS:-}" ]; then picked=("$CHAPTERS")
    elif [ -n "${GROUP:-}" ]; then picked=("${groups[$((GROUP - 1))]}")
    else picked=("${groups[@]}"); fi
    for chs in "${picked[@]}"; do
        tag=$(echo $chs | tr ' ' '-')
        python practice/judge.py mutate $chs --per-region "${PER_REGION:-all}" --list --json > "$out/mutants_$tag.json" || status=1
        python - "$out/mutants_$tag.json" "${JOBS:-14}" <<'PY' | tee -a "$out/mutate_summary.txt"
import json, sys
report, jobs = json.load(open(sys.argv[1])), int(sys.argv[2])
each = {"ch00": 4.8, "ch01": 6.0, "ch02": 13.0, "ch03": 6.4, "ch04": 6.1, "ch05": 6.6, "ch06": 6.8, "ch07": 8.9,
        "ch08": 10.8, "ch09": 15.4}  # seconds per mutant run on the H200, 14 at once
n = {c["chapter"]: sum(m["verdict"] is None for m in c["mutants"]) for c in report["chapters"]}
seconds = 1.15 * sum(k * each.get(c, 15.0) for c, k in n.items()) / jobs
print(f"estimate: {sum(n.values())} mutants to grade ({', '.join(f'{c} {k}' for c, k in n.items())}), "
      f"{jobs} at once: about {seconds / 60:.1f} min")
PY
        python practice/judge.py mutate $chs --per-region "${PER_REGION:-all}" --jobs "${JOBS:-14}" --json \
            > "$out/mutate_$tag.json" 2> "$out/mutate_$tag.log"
        rc=$?
        [ $rc -eq 0 ] || status=1  # 1: a mutant survived; 3: some not graded here; 2: it did not run
        python - "$out/mutate_$tag.json" <<'PY' | tee -a "$out/mutate_summary.txt"
import json, sys
try:
    report = json.load(open(sys.argv[1]))
except ValueError:
    sys.exit(f"{sys.argv[1]}: no report (see the .log beside it)")
for ch in report["chapters"] + [{"chapter": "group", "totals": report["totals"]}]:
    t = ch["totals"]
    print(ch["chapter"], "killed", t["killed"], "of", t["killed"] + t["survived"] + t["not_graded_here"],
          f"({t['killed_share']:.1%})" if t["killed_share"] is not None else "", "survived", t["survived"],
          "not graded here", t["not_graded_here"], "equivalent (listed)", t["equivalent_listed"],
          "invalid", t["invalid"], "identical dropped", t["identical_dropped"],
          *([f"in {report['seconds']:g} s ({report['tool']})"] if ch["chapter"] == "group" else []))
    for m in ch.get("mutants", []):
        if m["verdict"] == "survived":
            print("  survived:", m["exercise"], "line", m["line"], m["operator"], m["diff"].replace("\n", " | "))
PY
    done
    exit $status
fi
if [ "${1:-}" = "large-hot" ]; then
    python -m course_lib.bench hot-vs-cold --preset qwen3-8b --json "$out/hot_vs_cold_qwen3-8b.json" 2>&1 | grep -v "it/s]" || status=1
    PYTHONPATH=$PWD python scripts/disk_update_sweep.py --preset qwen3-8b --threads 16 --chunk-mb 64 --ring 4 8 --rollback both --probes \
        2>&1 | grep -v "it/s]" | tee "$out/disk_sweep_qwen3-8b.txt" || status=1
    exit $status
fi
if [ "${1:-}" = "kernels" ]; then
    for preset in qwen3-1.7b qwen3-8b; do
        python -m course_lib.bench copy-kernels --preset $preset --json "$out/copy_kernels_$preset.json" 2>&1 \
            | grep -v "it/s]" | tee "$out/copy_kernels_$preset.log" || status=1
    done
    exit $status
fi
if [ "${1:-}" = "profile" ]; then
    PYTHONPATH=$PWD python scripts/profile_update.py --preset qwen3-8b \
        --what first-token registered inproc-none inproc-int8 inproc-fp8 2>&1 | tee "$out/profile_qwen3-8b.txt" || status=1
    exit $status
fi
if [ "${1:-}" = "serve-load" ]; then
    # Streaming clients through updates at ~1.7B (every transport and pause mode). Needs FastAPI
    # and uvicorn: run bash scripts/server_wheels.sh on a machine with an index, then here
    # python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PYTHONPATH
    python -m course_lib.bench serve-load --preset qwen3-1.7b --device cuda --clients 64 --update-every-s 2 \
        --duration-s "${DURATION_S:-300}" --bucket-mb "${BUCKET_MB:-512}" --json "$out/serve_load_qwen3-1.7b.json" 2>&1 | grep -v "s/s]" | tee "$out/serve_load_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "verify" ]; then
    timeout "${TESTS_S:-240}" python -m pytest -m cuda -q -p no:cacheprovider -rfEs 2>&1 | tee "$out/pytest_cuda.log" \
        | tail -25 || status=1
    timeout "${CHECK_S:-330}" python practice/judge.py check --jobs "${JOBS:-14}" \
        ${CHAPTERS:-ch03 ch04 ch05 ch09 fast-bucket-update} 2>&1 | tee "$out/judge_check.log" | tail -12 || status=1
    exit $status
fi
if [ "${1:-}" = "serve-one-call" ]; then
    python -m course_lib.bench serve-load --preset qwen3-1.7b --device cuda --clients 64 --update-every-s 2 --one-call \
        --baseline-s "${BASELINE_S:-30}" --duration-s "${DURATION_S:-40}" --bucket-mb "${BUCKET_MB:-512}" \
        --json "$out/serve_one_call_qwen3-1.7b.json" 2>&1 | grep -v "s/s]" | tee "$out/serve_one_call_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "serve-baseline" ]; then
    # No trainer, no updates: what stops every stream, and what makes a first token slow, with
    # the server's engine steps, collections, Triton compiles and event-loop lateness traced
    # (and the clients' own pauses). Goals: no gap over 100 ms, time to first token p99 <= 200 ms.
    python -m course_lib.bench serve-load --preset qwen3-1.7b --device cuda --clients 64 --baseline-only --trace \
        --baseline-s "${BASELINE_S:-75}" --warmup-s 3 --json "$out/serve_baseline_qwen3-1.7b.json" 2>&1 \
        | grep -v "s/s]" | tee "$out/serve_baseline_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "serving" ]; then
    python -m pytest -m cuda -p no:cacheprovider -q -rfEs --continue-on-collection-errors \
        > "$out/pytest_cuda_serving.log" 2>&1 || status=1
    grep -E "passed|failed|^FAILED|^ERROR|Error" "$out/pytest_cuda_serving.log" | tail -30
    python -m course_lib.bench decode --preset qwen3-8b --batch 1 8 --profile --json "$out/decode_qwen3-8b.json" 2>&1 \
        | grep -v "it/s]" | tee "$out/decode_qwen3-8b.log" || status=1
    python -m course_lib.bench hot-vs-cold --preset qwen3-8b --json "$out/hot_vs_cold_qwen3-8b.json" 2>&1 \
        | grep -v "it/s]" | tee "$out/hot_vs_cold_qwen3-8b.log" || status=1
    python -m course_lib.bench update --preset qwen3-8b --parts loop inproc --json "$out/update_inproc_qwen3-8b.json" 2>&1 \
        | grep -v "it/s]" | tee "$out/update_inproc_qwen3-8b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "two-gpu" ]; then  # issue "Two GPUs": the TP=2 tests, then trainer -> engine over NCCL against raw NCCL
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$gpus" -lt 2 ]; then
        echo "two-gpu: this machine has $gpus GPU(s); the two-GPU tests and benchmarks need 2" | tee "$out/two_gpu_skipped.txt"
        exit 3
    fi
    PYTHONPATH=$PWD python scripts/nccl_graph_teardown.py 2>&1 | tee "$out/nccl_graph_teardown.txt" || status=1
    timeout 300 python -m pytest -p no:cacheprovider -q -rfEs tests/test_tp.py tests/test_two_gpus.py -o faulthandler_timeout=240 \
        2>&1 | tee "$out/pytest_tp.log" || status=1
    for preset in qwen3-1.7b qwen3-8b; do
        python -m course_lib.bench transports --two-gpus --broadcast-preset $preset --bucket-mb 512 \
            --json "$out/broadcast_nccl_$preset.json" 2>&1 | grep -v "it/s]" | tee "$out/broadcast_nccl_$preset.log" || status=1
    done
    exit $status
fi
if [ "${1:-}" = "broadcast" ]; then  # what one GPU can say about the NCCL path (the wire itself needs two)
    PYTHONPATH=$PWD python scripts/nccl_graph_teardown.py 2>&1 | tee "$out/nccl_graph_teardown_1gpu.txt" || status=1
    python -m course_lib.bench transports --broadcast-preset qwen3-1.7b --bucket-mb 512 --rounds 3 \
        --json "$out/broadcast_gloo_qwen3-1.7b.json" 2>&1 | grep -v "it/s]" | tee "$out/broadcast_gloo_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "update" ]; then  # every update path at ~1.7B (InstantTensor beside the disk path when installed)
    python -m pytest -m cuda -p no:cacheprovider -q -rfEs --continue-on-collection-errors \
        > "$out/pytest_cuda.log" 2>&1 || status=1
    grep -E "passed|failed|^FAILED|^ERROR|^SKIPPED" "$out/pytest_cuda.log" | tail -40
    python -m course_lib.bench update --preset qwen3-1.7b --bucket-mb 512 --json "$out/update_qwen3-1.7b.json" 2>&1 \
        | grep -v "it/s]" | tee "$out/update_qwen3-1.7b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "update-large" ]; then  # the same at ~8B (one call: under ten minutes)
    python -m course_lib.bench update --preset qwen3-8b --bucket-mb 1024 --json "$out/update_qwen3-8b.json" 2>&1 \
        | grep -v "it/s]" | tee "$out/update_qwen3-8b.log" || status=1
    exit $status
fi
if [ "${1:-}" = "large" ]; then
    python -m course_lib.bench decode --preset qwen3-8b --batch 1 8 --json "$out/decode_qwen3-8b.json" || status=1
    python -m course_lib.bench update --preset qwen3-8b --bucket-mb 1024 --json "$out/update_qwen3-8b.json" 2>&1 | grep -v "it/s]" || status=1
    exit $status
fi
python -m pytest -m cuda -p no:cacheprovider -q -rA --continue-on-collection-errors 2>&1 | tee "$out/pytest_cuda.log" || status=1
# Chapters whose tests drive the HTTP server need FastAPI and httpx; a GPU machine without
# them cannot grade those chapters (they have no GPU case: the CPU suite grades them).
chapters=$(ls practice/chapters | grep '^ch[0-9][0-9]$')
if ! python -c "import fastapi, httpx" 2>/dev/null; then
    http=$(grep -l "course_lib.server\|fastapi" practice/chapters/ch*/test_public.py | xargs -n1 dirname | xargs -n1 basename)
    echo "no FastAPI/httpx here: not graded on this machine (no GPU case; the CPU suite grades them):" $http | tee "$out/skipped.txt"
    chapters=$(echo "$chapters" | grep -v -x -F "$http")
fi
# The chapters' exercises on this GPU: every case graded, CUDA ones included (exit 0 expected).
for ch in $chapters; do
    python practice/judge.py test "$ch" 2>&1 | tee "$out/judge_test_$ch.log" || status=1
done
# The judge's CUDA cases (graded here, "not graded" on CPU machines): references pass,
# stubs and wrong answers fail, for chapters and problems.
# bucket-handoff's CUDA IPC case has failed its reference 2 times in 12 with many runs at once
# on one GPU (results/h200-2026-12-01b/): it is checked on its own, after the others.
python practice/judge.py check --jobs 8 $chapters $(ls practice/problems | grep -v -x bucket-handoff) 2>&1 \
    | tee "$out/judge_check.log" || status=1
python practice/judge.py check bucket-handoff 2>&1 | tee "$out/judge_check_bucket_handoff.log" || status=1
if [ "${1:-}" = "tests" ]; then
    exit $status
fi
# The speed problem on this GPU: the reference answer and the starter (the engine's general
# loaders) beside the judge's reference and one flat device copy.
for f in solution starter; do
    python practice/judge.py bench fast-bucket-update --file "practice/problems/fast-bucket-update/$f.py" --json \
        > "$out/bench_fast_bucket_update_$f.json" || status=1
done
python -m course_lib.bench decode --preset qwen3-0.6b --batch 1 8 --json "$out/decode_qwen3-0.6b.json" || status=1
python -m course_lib.bench update --preset qwen3-1.7b --bucket-mb 512 --json "$out/update_qwen3-1.7b.json" 2>&1 | grep -v "it/s]" || status=1
python -m course_lib.bench transports --json "$out/transports.json" 2>&1 | grep -v "it/s]" || status=1
if [ "$(nvidia-smi -L | wc -l)" -ge 2 ]; then  # two GPUs here: the NCCL broadcast benchmarks too
    OUT="$out" bash "$0" two-gpu || status=1
fi
exit $status
