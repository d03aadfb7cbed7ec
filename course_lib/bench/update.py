"""How fast each hot-update path moves the bytes, against the hardware's own limits.

    python -m course_lib.bench update --preset qwen3-1.7b --json out.json

Measured in one run, on the same checkpoint:

- baselines: one large device-to-device copy of the model's bytes (GPU) or memcpy (CPU);
  host-to-device from pinned and from pageable memory (GPU);
- a plain per-tensor ``param.copy_(src)`` loop from tensors already on the device (what a
  naive in-process update does);
- SGLang-style buckets: a separate trainer process hands over flattened buckets (CUDA IPC
  handles on GPU, shared memory on CPU) through ``update_weights_from_tensor``, three
  steps through the same two buffers (the engine resumes and pauses again between steps,
  as it does between a trainer's steps); engine-side time (the calls) with its phases
  (deserialize, validate, copy, audit) and end to end (including the trainer packing each
  bucket), for the last step and the first (which opens each handle and validates each
  layout); then the same with the engine's bucket cache switched off (the general path:
  every bucket unpacked, checked and copied tensor by tensor);
- registered buffers (the same trainer, registering once, then sending bucket numbers),
  so the two ways a trainer can push its weights stand side by side;
- disk: ``update_weights_from_disk`` from a page-cached checkpoint, layer by layer and
  with full staging, through the engine's own reader; layer by layer through InstantTensor
  too, when that optional package is installed (``COURSE_LIB_DISK_READER``);
- InstantTensor's ``safe_open`` (its buffered backends) reading the same files to the
  GPU, when that optional package is installed, with the disk path's ratio to it;
- transformers' ``model.load_state_dict(load_file(...))`` on the same files, when
  transformers is installed (what a user would otherwise do).

Every rate is payload bytes per second; ratios are against the baselines above.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import tempfile
import time

import torch
from tqdm import tqdm

from course_lib import Engine, settings
from course_lib.bench import run_header, save_json
from course_lib.config import is_cuda
from course_lib.layers.quant import kernel_tensors
from course_lib.weights.checkpoint import instanttensor_reader
from course_lib.weights.commit import copy_table
from course_lib.weights.checkpoint import CheckpointReader, make_random
from course_lib.weights.commit.layerwise import layer_key
from course_lib.weights.transports import trainer
from course_lib.weights.commit.validate import UpdateError


def sync(device):
    if is_cuda(device):
        torch.cuda.synchronize()


def median_time(fn, device, repeat=5, warmup=1) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def copy_baselines(nbytes: int, device: str) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8, device=device).random_()
    dst = torch.empty_like(src)
    out = {"copy_gbps": nbytes / median_time(lambda: dst.copy_(src), device) / 1e9}
    if is_cuda(device):
        for name, pinned in (("h2d_pinned_gbps", True), ("h2d_pageable_gbps", False)):
            host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pinned)
            out[name] = nbytes / median_time(lambda: dst.copy_(host, non_blocking=pinned), device, repeat=3) / 1e9
            del host
    del src, dst
    return out


def per_tensor_loop(engine: Engine, reader: CheckpointReader) -> float:
    """Seconds for ``param.copy_(src)`` over every kernel tensor, sources already on the device."""
    live = kernel_tensors(engine.model)
    sources = {n: torch.empty_like(t).copy_(t) for n, t in live.items() if t.is_floating_point()}

    def loop():
        for name, src in sources.items():
            live[name].copy_(src)
    seconds = median_time(loop, engine.config.device)
    nbytes = sum(t.numel() * t.element_size() for t in sources.values())
    del sources
    return nbytes / seconds / 1e9


def take_round(item, payloads, acks, apply) -> dict:
    """Apply one round's messages from a trainer process (``item`` is its first; the
    round ends with None), acknowledging each: bytes, engine-side and end-to-end GB/s,
    and the engine's milliseconds by phase."""
    t_start, engine_s, nbytes, phases = time.perf_counter(), 0.0, 0, {}
    while item is not None:
        receipt, payload = item
        t0 = time.perf_counter()
        result = apply(payload)
        engine_s += time.perf_counter() - t0
        nbytes += result["bytes"]
        for phase, ms in result["timings_ms"].items():
            phases[phase] = phases.get(phase, 0.0) + ms
        acks.put(receipt)
        item = payloads.get(timeout=600)
    return {"bytes": nbytes, "engine_gbps": nbytes / engine_s / 1e9,
            "end_to_end_gbps": nbytes / (time.perf_counter() - t_start) / 1e9, "engine_ms_by_phase": phases}


def ipc_update(engine: Engine, path, bucket_bytes: int, rounds: int = 3, cache: bool = True) -> dict:
    """A trainer process pushes the checkpoint ``rounds`` times through the same two
    buffers as SGLang-style flattened buckets, the engine resuming and pausing again
    between rounds (a trainer's steps); returns engine-side and end-to-end GB/s and the
    engine's phases of the last round (the steady state of a trainer that updates every
    step) and of the first (which also opens each IPC handle, validates each layout and
    builds its copy table). ``cache=False``: the engine's bucket cache switched off, every
    bucket through the general path."""
    ctx = mp.get_context("spawn")
    payloads, acks = ctx.Queue(), ctx.Queue()
    child = ctx.Process(target=trainer.push_ipc,
                        args=(path, payloads, acks, bucket_bytes, engine.config.device, 2, rounds))
    child.start()
    buckets = engine.updater.transfers.buckets
    buckets.enabled, before = cache, dict(buckets.stats)
    per_round = []
    try:
        item = payloads.get(timeout=600)  # the trainer has loaded its weights and packed bucket 0
        for _ in range(rounds):
            engine.pause_generation("abort")
            per_round.append(take_round(item, payloads, acks, lambda payload: engine.update_weights_from_tensor(
                payload, load_format="flattened_bucket", flush_cache=False)))
            engine.flush_cache()
            engine.continue_generation()  # between steps (on a GPU: unmaps buffers the step did not use)
            if len(per_round) < rounds:
                item = payloads.get(timeout=600)  # the next round's first bucket
        trainer.wait_for_exit(child, 600)
    finally:
        buckets.enabled = True
    stats = {k: v - before.get(k, 0) for k, v in buckets.stats.items()}
    return {**per_round[-1], "rounds": rounds, "cache": cache, "cache_stats": stats, "first_round": per_round[0]}


def registered_update(engine: Engine, path, bucket_bytes: int, resident: bool, rounds: int = 2,
                      compare_modes: bool = False) -> dict:
    """A trainer process registers its buffers once, then pushes the checkpoint ``rounds``
    times by bucket number (``update_weights_from_registered``). ``resident``: its weights
    live in the registered buffer (no packing, one message per round); else it packs
    into two reused buffers. Engine-side and end-to-end GB/s of the last round; with
    ``compare_modes``, also the engine-side GB/s of each copy mode (loop, foreach, graph,
    scatter) on the same registration, copying every bucket in one call."""
    ctx = mp.get_context("spawn")
    payloads, acks = trainer.Channel(ctx), trainer.Channel(ctx)  # see Channel: no feeder thread
    child = ctx.Process(target=trainer.push_registered,
                        args=(path, payloads, acks, bucket_bytes, engine.config.device, 2, rounds, resident))
    child.start()
    engine.pause_generation("abort")
    kind, registration = payloads.get(timeout=600)
    modes = {}
    for mode in (copy_table.COPY_MODES if compare_modes else ()):
        if mode in ("graph", "scatter") and not is_cuda(engine.config.device):
            continue
        try:
            reg = engine.register_weight_buffers(registration, copy_mode=mode)
        except UpdateError as exc:  # e.g. scatter without Triton: say so, measure the others
            modes[mode] = str(exc)
            continue
        every = list(range(reg["buckets"]))
        seconds = median_time(lambda: engine.update_weights_from_registered(every, reg["epoch"], flush_cache=False),
                              engine.config.device)
        modes[mode] = reg["bytes"] / seconds / 1e9
    t0 = time.perf_counter()
    reg = engine.register_weight_buffers(registration)
    register_ms = 1e3 * (time.perf_counter() - t0)
    acks.put(reg["epoch"])
    per_round = [take_round(payloads.get(timeout=600), payloads, acks,
                            lambda message: engine.update_weights_from_registered(**message, flush_cache=False))
                 for _ in range(rounds)]
    trainer.wait_for_exit(child, 600)
    engine.unregister_weight_buffers()
    engine.flush_cache()
    engine.continue_generation()
    return {**per_round[-1], "copy_mode": reg["copy_mode"], "register_ms": register_ms, "buckets": reg["buckets"],
            "first_round": per_round[0], **({"engine_gbps_by_copy_mode": modes} if modes else {})}


def in_process_update(a, b, device: str, quantization: str | None) -> float:
    """GB/s of ``update_weights_from_tensor`` with every tensor already on the engine's
    device (a trainer in the same process: no IPC), into an engine with ``quantization``."""
    engine = Engine(a, device=device, max_num_seqs=8, max_model_len=512, quantization=quantization)
    tensors = list(CheckpointReader(b).iter_tensors(device=device if is_cuda(device) else "cpu"))
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    engine.pause_generation("abort")
    seconds = median_time(lambda: engine.update_weights_from_tensor(tensors, flush_cache=False), device, repeat=3)
    engine.continue_generation()
    del engine, tensors
    return nbytes / seconds / 1e9


def largest_layer_bytes(reader: CheckpointReader) -> int:
    """Bytes of the largest unit a layer-by-layer update holds (a decoder layer, or the
    embedding / LM head alone)."""
    per_layer: dict[str, int] = {}
    for name, (shape, dtype) in reader.metadata().items():
        key = layer_key(name)
        per_layer[key] = per_layer.get(key, 0) + torch.Size(shape).numel() * dtype.itemsize
    return max(per_layer.values())


def transformers_load(path, device: str) -> float | None:
    """GB/s of transformers' load_state_dict(load_file(...)) into a model already built."""
    try:
        import transformers
        from safetensors.torch import load_file
    except ImportError:
        return None
    reader = CheckpointReader(path)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device(device):
        model = transformers.Qwen3ForCausalLM(config).to(reader.config.dtype)
    files = sorted({str(f) for f in reader.files.values()})

    def load():
        for f in files:
            model.load_state_dict(load_file(f, device=str(device)), strict=False)
    gbps = reader.nbytes() / median_time(load, device, repeat=3) / 1e9
    del model
    return gbps


def instanttensor_load(path, device: str) -> dict:
    """GB/s of InstantTensor (an optional loader, ``pip install instanttensor``) reading the
    same files to the GPU with its buffered backends (io_uring, else mmap), each tensor
    copied into a tensor allocated beforehand, as a loader fills a model. The page cache is
    warmed by a first read, as the disk rows' is. ``{"skipped": why}`` without the package
    or without CUDA."""
    why = instanttensor_reader.unavailable(device)
    if why:
        return {"skipped": why}
    from instanttensor import BackendPolicy, safe_open
    reader = CheckpointReader(path)
    files = sorted({str(f) for f in reader.files.values()})
    dest = {name: torch.empty(shape, dtype=dtype, device=device) for name, (shape, dtype) in reader.metadata().items()}

    def load():
        with safe_open(files, framework="pt", device=instanttensor_reader.numbered(device), copy=False,
                       backend=BackendPolicy.BUFFERED) as f:
            for name, t in f.tensors():
                dest[name].copy_(t)  # the yielded tensor is valid until the next one
    gbps = reader.nbytes() / median_time(load, device, repeat=3) / 1e9
    del dest
    return {"gbps": gbps}


def parse_args(argv):
    p = argparse.ArgumentParser(prog="python -m course_lib.bench update")
    p.add_argument("--preset", default="tiny")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--bucket-mb", type=int, default=512)
    p.add_argument("--no-transformers", action="store_true")
    p.add_argument("--parts", nargs="+", default=["loop", "ipc", "registered", "disk", "instanttensor", "inproc",
                                                  "transformers"],
                   help="which measurements to run (the copy baselines always run)")
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def disk_rows(engine, a, b, nbytes: int, device: str, gpu: bool) -> dict:
    """The disk update layer by layer and fully staged (and through InstantTensor where it
    is installed), each from page-cached files, the page cache warmed by a first update."""
    rows, out = [("layer", "own"), ("full", "own")], {}
    if gpu and instanttensor_reader.unavailable(device) is None:
        rows.insert(1, ("layer", "instanttensor"))  # the same update through the optional reader
    for staging, reader_choice in rows:
        key = f"disk_{staging}" + ("_instanttensor" if reader_choice == "instanttensor" else "")
        with settings.overridden("COURSE_LIB_DISK_READER", reader_choice):
            engine.update_weights_from_disk(a if staging == "layer" else b, staging=staging)  # warm the page cache
            t0 = time.perf_counter()
            r = engine.update_weights_from_disk(b, staging=staging)
        out[key] = {"gbps": nbytes / (time.perf_counter() - t0) / 1e9, "reader": reader_choice,
                    "timings_ms": r["timings_ms"], "memory": dict(r.get("memory") or {}), "writer": r["writer"]}
        if reader_choice == "instanttensor" and "gpu_peak_extra_bytes" in out[key]["memory"]:
            ring = instanttensor_reader.last_ring_bytes  # cudaMalloc'ed: torch's peak does not see it
            out[key]["memory"]["instanttensor_ring_bytes"] = ring
            out[key]["memory"]["gpu_peak_extra_bytes"] += ring
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    device, gpu = args.device, is_cuda(args.device)
    res = run_header("update", device, preset=args.preset, bucket_mb=args.bucket_mb)
    steps = tqdm(total=5, desc="update benchmark")
    res["bucket_bytes"] = args.bucket_mb << 20
    with tempfile.TemporaryDirectory() as tmp:
        a = make_random(f"{tmp}/a", args.preset, seed=1, device=device if gpu else "cpu")
        b = make_random(f"{tmp}/b", args.preset, seed=2, device=device if gpu else "cpu")
        reader = CheckpointReader(b)
        res["model_bytes"] = nbytes = reader.nbytes()
        res.update(copy_baselines(nbytes, device)); steps.update()
        t0 = time.perf_counter()
        engine = Engine(a, device=device, max_num_seqs=8, max_model_len=512)
        res["engine_start_s"] = time.perf_counter() - t0
        if "loop" in args.parts:
            res["per_tensor_copy_gbps"] = per_tensor_loop(engine, reader)
        steps.update()
        if "ipc" in args.parts:
            res["ipc"] = ipc_update(engine, b, args.bucket_mb << 20)
            res["ipc_general"] = ipc_update(engine, b, args.bucket_mb << 20, cache=False)
        if "registered" in args.parts:
            res["registered"] = registered_update(engine, b, args.bucket_mb << 20, resident=False)
            res["registered_resident"] = registered_update(engine, a, args.bucket_mb << 20, resident=True,
                                                           compare_modes=True)
            engine.update_weights_from_disk(b, staging="full")  # back to b for the disk runs' first step
        steps.update()
        if "disk" in args.parts:
            res.update(disk_rows(engine, a, b, nbytes, device, gpu))
        steps.update()
        res["largest_layer_bytes"] = largest_layer_bytes(reader)
        del engine
        if "instanttensor" in args.parts:  # the same page-cached files as the disk rows
            res["instanttensor"] = instanttensor_load(b, device)
        if gpu:
            torch.cuda.empty_cache()
        if "inproc" in args.parts:
            res["in_process_gbps"] = {str(q): in_process_update(a, b, device, q)
                                      for q in (None, "int8", "fp8") if q is None or gpu or q == "int8"}
        use_hf = "transformers" in args.parts and not args.no_transformers
        res["transformers_gbps"] = transformers_load(b, device) if use_hf else None
        steps.update()
    steps.close()
    report(res)
    save_json(res, args.json)
    return res


def report(r: dict) -> None:
    """Every figure as a rate and a ratio against the baseline measured in the same run."""
    copy, h2d = r["copy_gbps"], r.get("h2d_pinned_gbps")
    print(f"\nhot update, preset {r['preset']} ({r['model_bytes'] / 1e9:.2f} GB), {r['hardware']}, {r['date']}")
    print(f"  baseline copy (device-to-device / memcpy)  {copy:8.1f} GB/s")
    if h2d:
        print(f"  baseline host-to-device pinned / pageable  {h2d:8.1f} / {r['h2d_pageable_gbps']:.1f} GB/s")
    for name, gbps, denom, base in report_rows(r, copy, h2d):
        ratio = f"{gbps / denom:6.0%} of {base}" if denom else ""
        print(f"  {name:<46} {gbps:8.1f} GB/s  {ratio}")
    report_notes(r)


def report_rows(r: dict, copy: float, h2d: float | None) -> list:
    """(label, GB/s, baseline GB/s, baseline's name) per measured path."""
    rows = []
    if "per_tensor_copy_gbps" in r:
        rows.append(("per-tensor copy_ loop", r["per_tensor_copy_gbps"], copy, "copy"))
    if "ipc" in r:
        rows += [("SGLang-style buckets, engine side", r["ipc"]["engine_gbps"], copy, "copy"),
                 ("SGLang-style buckets, end to end", r["ipc"]["end_to_end_gbps"], copy, "copy"),
                 ("SGLang-style buckets, first step, engine side", r["ipc"]["first_round"]["engine_gbps"], copy,
                  "copy")]
    if "ipc_general" in r:
        rows.append(("SGLang-style buckets, no cache, engine side", r["ipc_general"]["engine_gbps"], copy, "copy"))
    for key, label in (("registered", "registered, 2 buffers"), ("registered_resident", "registered, resident")):
        if key in r:
            rows += [(f"{label}, engine side", r[key]["engine_gbps"], copy, "copy"),
                     (f"{label}, end to end", r[key]["end_to_end_gbps"], copy, "copy")]
    for mode, gbps in r.get("registered_resident", {}).get("engine_gbps_by_copy_mode", {}).items():
        if isinstance(gbps, str):
            print(f"  registered copy mode {mode!r}: not measured ({gbps})")
            continue
        rows.append((f"registered copy mode {mode!r}", gbps, copy, "copy"))
    for q, gbps in r.get("in_process_gbps", {}).items():
        rows.append((f"in-process from device tensors, {'unquantized' if q == 'None' else q}", gbps, copy, "copy"))
    for key, label in (("disk_layer", "disk, layer by layer"),
                       ("disk_layer_instanttensor", "disk, layer by layer, InstantTensor reader"),
                       ("disk_full", "disk, full staging")):
        if key in r:
            rows.append((label, r[key]["gbps"], h2d, "pinned H2D"))
    it = r.get("instanttensor") or {}
    if "gbps" in it:
        rows.append(("InstantTensor safe_open (buffered) to the GPU", it["gbps"], h2d, "pinned H2D"))
    elif it:
        print(f"  InstantTensor: not measured ({it['skipped']})")
    return rows


def report_notes(r: dict) -> None:
    """Where the time went, the caches' hits, the ratios to other loaders, the extra memory."""
    it = r.get("instanttensor") or {}
    for key in ("ipc", "ipc_general", "registered", "registered_resident"):
        if key in r:
            print(f"  {key} engine-side ms by phase: "
                  + ", ".join(f"{k} {v:.2f}" for k, v in r[key]["engine_ms_by_phase"].items()))
    if "ipc" in r:
        stats = r["ipc"]["cache_stats"]
        print(f"  SGLang-style buckets over {r['ipc']['rounds']} steps: {stats['layouts_validated']} layouts "
              f"validated, {stats['layout_hits']} found again; {stats['tables_built']} copy tables built, "
              f"{stats['table_hits']} found again")
        if "registered" in r:
            print(f"  SGLang-style buckets / registered (2 buffers), engine side: "
                  f"{r['ipc']['engine_gbps'] / r['registered']['engine_gbps']:.2f}")
    for key, label in (("disk_layer", "own reader"), ("disk_layer_instanttensor", "InstantTensor reader")):
        if "gbps" in it and key in r:
            print(f"  disk layer by layer ({label}) / InstantTensor loading, same files, same run: "
                  f"{r[key]['gbps'] / it['gbps']:.2f}")
    if r.get("transformers_gbps") and "disk_layer" in r:
        print(f"  transformers load_state_dict(load_file) {r['transformers_gbps']:8.1f} GB/s; "
              f"disk layer-by-layer is {r['disk_layer']['gbps'] / r['transformers_gbps']:.1f}x that")
    for key, label in (("disk_layer", "own reader"), ("disk_layer_instanttensor", "InstantTensor reader")):
        extra = ((r.get(key) or {}).get("memory") or {}).get("gpu_peak_extra_bytes")
        if extra is not None and "largest_layer_bytes" in r:
            bound = r["largest_layer_bytes"] + 2 * r["bucket_bytes"]
            print(f"  extra GPU memory during a disk update ({label}) {extra / 1e9:.2f} GB = {extra / bound:.2f}x "
                  f"(largest layer {r['largest_layer_bytes'] / 1e9:.2f} GB + 2 buckets)")


if __name__ == "__main__":
    main()
