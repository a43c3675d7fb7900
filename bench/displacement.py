"""Benchmark: weight displacement of two ~1 GB bf16 checkpoints (Qwen2.5-0.5B shapes, random weights), in two
layouts: sharded (4 shards + index per side) and single-file (one model.safetensors per side).

Side by side, in one run, each approach in its own fresh process, timed after its imports:
  floor     read both checkpoints' bytes once, no arithmetic (floor: one thread, floor2: two threads; per round the
            better of the two is the floor)
  mechdiag  mechdiag.displacement.compare (streams the memory-mapped tensors through the fused C kernel)
  hand      what a user writes: load both state dicts (safetensors.torch.load_file), loop, .float(), norms
  cli       `python -m mechdiag displacement A B --format json --out F`, whole process (imports included)
Rounds alternate cases and approaches; ratios are taken per round against that round's floor / hand and reported
as the median over rounds with their range. Peak private memory = peak RssAnon (anonymous pages; the file pages
of memory-mapped checkpoints, which the OS can drop, are not counted), sampled every 1 ms in the measured process.
Cache state: "cold" evicts the benchmark files from the page cache first (posix_fadvise DONTNEED on our own files
only); "warm" has them cached.
Then the LoRA part: a rank-16 adapter on all 7 projections of all 24 layers, delta metrics from the factors vs
from the materialised s*B@A; and the cost of --spectral's update geometry on a rank-16 adapter (14 modules) vs
float64 SVDs of the same weights.

    python bench/displacement.py --rounds 5 --cache warm --no-lora   # writes bench/_work/ (about 4 GB) on first use
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
WORK = ROOT / "bench" / "_work"
HIDDEN, INTER, LAYERS, VOCAB, HEADS, KV_HEADS, HEAD_DIM = 896, 4864, 24, 151936, 14, 2, 64
SHARD_BYTES = 300_000_000


def qwen_shapes() -> dict[str, tuple[int, ...]]:
    kv = KV_HEADS * HEAD_DIM
    shapes = {"model.embed_tokens.weight": (VOCAB, HIDDEN)}
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (HIDDEN,), p + "post_attention_layernorm.weight": (HIDDEN,),
            p + "self_attn.q_proj.weight": (HIDDEN, HIDDEN), p + "self_attn.q_proj.bias": (HIDDEN,),
            p + "self_attn.k_proj.weight": (kv, HIDDEN), p + "self_attn.k_proj.bias": (kv,),
            p + "self_attn.v_proj.weight": (kv, HIDDEN), p + "self_attn.v_proj.bias": (kv,),
            p + "self_attn.o_proj.weight": (HIDDEN, HIDDEN),
            p + "mlp.gate_proj.weight": (INTER, HIDDEN), p + "mlp.up_proj.weight": (INTER, HIDDEN),
            p + "mlp.down_proj.weight": (HIDDEN, INTER)})
    shapes["model.norm.weight"] = (HIDDEN,)
    return shapes


def make_checkpoints() -> tuple[Path, Path]:
    """Two sharded bf16 checkpoints: A random, B = A + a small update on every tensor (a full fine-tune)."""
    import torch
    from safetensors.torch import save_file

    a_dir, b_dir = WORK / "a", WORK / "b"
    if (b_dir / "model.safetensors.index.json").exists():
        return a_dir, b_dir
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": HIDDEN,
              "intermediate_size": INTER, "num_hidden_layers": LAYERS, "num_attention_heads": HEADS,
              "num_key_value_heads": KV_HEADS, "vocab_size": VOCAB, "tie_word_embeddings": True,
              "torch_dtype": "bfloat16"}
    shapes = qwen_shapes()
    for d in (a_dir, b_dir):
        d.mkdir(parents=True, exist_ok=True)
        (d / "config.json").write_text(json.dumps(config))
    g = torch.Generator().manual_seed(0)
    shards: list[list[str]] = [[]]
    size = 0
    for name, shape in shapes.items():
        n = 2 * int(torch.tensor(shape).prod())
        if size + n > SHARD_BYTES and shards[-1]:
            shards.append([])
            size = 0
        shards[-1].append(name)
        size += n
    weight_map = {}
    for i, names in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        sa, sb = {}, {}
        for name in names:
            w = torch.randn(shapes[name], generator=g) * 0.02
            sa[name] = w.to(torch.bfloat16)
            sb[name] = (w + 2e-4 * torch.randn(shapes[name], generator=g)).to(torch.bfloat16)
            weight_map[name] = fname
        save_file(sa, a_dir / fname, metadata={"format": "pt"})
        save_file(sb, b_dir / fname, metadata={"format": "pt"})
        print(f"  wrote shard {i + 1}/{len(shards)}", file=sys.stderr)
    for d in (a_dir, b_dir):
        (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return a_dir, b_dir


def make_single_files(a_dir: Path, b_dir: Path) -> tuple[Path, Path]:
    """The same two checkpoints as one model.safetensors each (how models up to ~2 GB ship), tensors in the
    sharded checkpoint's order; one side in memory at a time."""
    import torch  # noqa: F401  (safetensors.torch needs it)
    from safetensors.torch import load_file, save_file

    out = []
    for src in (a_dir, b_dir):
        dst = WORK / f"single_{src.name}"
        out.append(dst)
        if (dst / "model.safetensors").exists():
            continue
        dst.mkdir(parents=True, exist_ok=True)
        (dst / "config.json").write_text((src / "config.json").read_text())
        tensors = {}
        for p in files_of(src):
            tensors.update(load_file(p))
        tmp = dst / "model.safetensors.tmp"
        save_file(tensors, tmp, metadata={"format": "pt"})
        tmp.rename(dst / "model.safetensors")
        del tensors
        print(f"  wrote {dst}/model.safetensors", file=sys.stderr)
    return out[0], out[1]


def files_of(*dirs: Path) -> list[Path]:
    return sorted(p for d in dirs for p in d.glob("*.safetensors"))


def evict(paths: list[Path]) -> None:
    """Drop these files (only these) from the page cache."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm(paths: list[Path]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(1 << 24):
                pass


# --- measured workers (run in a fresh process) ------------------------------------------------------------------


class AnonPeak:
    """Peak RssAnon of this process, sampled every ~1 ms by a thread."""

    def __init__(self):
        self.peak = self.start = self.read()
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def read() -> int:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("RssAnon:"):
                    return int(line.split()[1]) * 1024
        return 0

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.read())
            time.sleep(0.001)

    def __enter__(self):
        self._t.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, self.read())


def worker(kind: str, a: Path, b: Path) -> dict:
    import torch
    from safetensors.torch import load_file

    sys.path.insert(0, str(ROOT))
    from mechdiag.displacement import compare, kernel_enabled

    out: dict = {}
    with AnonPeak() as mem:
        t0, c0 = time.perf_counter(), time.process_time()
        if kind in ("floor", "floor2"):  # floor2: the two checkpoints read by two threads at once
            def read_all(paths):
                buf, total = bytearray(1 << 24), 0
                for p in paths:
                    with open(p, "rb", buffering=0) as f:
                        while n := f.readinto(buf):
                            total += n
                return total

            if kind == "floor":
                out["bytes"] = read_all(files_of(a, b))
            else:
                from concurrent.futures import ThreadPoolExecutor

                with ThreadPoolExecutor(2) as pool:
                    out["bytes"] = sum(pool.map(read_all, [files_of(a), files_of(b)]))
        elif kind in ("mechdiag", "mechdiag_torch"):  # mechdiag_torch: the C kernel switched off
            os.environ["MECHDIAG_KERNEL"] = "1" if kind == "mechdiag" else "0"
            out["kernel"] = kernel_enabled()
            rows = compare(a, b)
            out["n_rows"] = len(rows)
            out["check"] = sum(r["delta_fro"] ** 2 for r in rows)
        elif kind == "hand":
            sa, sb = {}, {}
            for p in files_of(a):
                sa.update(load_file(p))
            for p in files_of(b):
                sb.update(load_file(p))
            rows = []
            for k, wa in sa.items():
                wa32, wb32 = wa.float(), sb[k].float()
                ref, delta = wa32.norm().item(), (wb32 - wa32).norm().item()
                rows.append({"name": k, "ref_fro": ref, "delta_fro": delta, "rel_fro": delta / ref})
            out["n_rows"] = len(rows)
            out["check"] = sum(r["delta_fro"] ** 2 for r in rows)
        out["seconds"] = time.perf_counter() - t0
        out["cpu_seconds"] = time.process_time() - c0
    out["peak_anon_mb"] = mem.peak / 1e6
    out["anon_after_imports_mb"] = mem.start / 1e6
    out["threads"] = torch.get_num_threads()
    return out


def run_worker(kind: str, a: Path, b: Path) -> dict:
    proc = subprocess.run([sys.executable, __file__, "--worker", kind, str(a), str(b)], capture_output=True,
                          text=True, check=True)
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_cli(a: Path, b: Path) -> float:
    out = WORK / "cli.json"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "mechdiag", "displacement", str(a), str(b), "--format", "json", "--out",
                    str(out)], check=True, env=env, capture_output=True)
    return time.perf_counter() - t0


# --- LoRA: factors vs materialised ------------------------------------------------------------------------------


def lora_bench(rank: int = 16, repeats: int = 3) -> dict:
    import torch

    sys.path.insert(0, str(ROOT))
    from mechdiag.displacement import lowrank_factors, lowrank_sumsq, lowrank_svdvals
    from mechdiag.weights import LoraFactor

    shapes = [s for n, s in qwen_shapes().items() if n.endswith("proj.weight")]
    g = torch.Generator().manual_seed(0)
    terms = [LoraFactor(2.0, (torch.randn(o, rank, generator=g) * 0.01).to(torch.bfloat16),
                        (torch.randn(rank, i, generator=g) * 0.01).to(torch.bfloat16)) for o, i in shapes]

    spectral_terms = terms[:14]  # spectra: layers 0-1 only (a full SVD per materialised module is slow); same set

    def factors(spectral):
        for t in (spectral_terms if spectral else terms):
            B, A = lowrank_factors([t])
            lowrank_sumsq(B, A)
            if spectral:
                lowrank_svdvals(B, A)

    def materialised(spectral):
        for t in (spectral_terms if spectral else terms):
            d = t.scale * (t.B.float() @ t.A.float())
            torch.linalg.vector_norm(d)
            if spectral:
                torch.linalg.matrix_norm(d, ord=2)

    res = {"n_modules": len(terms), "n_spectral": len(spectral_terms), "rank": rank}
    default_threads = torch.get_num_threads()
    for spectral in (False, True):
        for name, fn in (("factors", factors), ("materialised", materialised)):
            # mechdiag runs the factor path single-threaded (single_thread()); the materialised path gets the better
            # of the default thread count and one thread
            best = math.inf
            thread_counts = [1] if name == "factors" or spectral else sorted({1, default_threads})
            for threads in thread_counts:
                torch.set_num_threads(threads)
                if name == "factors":
                    fn(spectral)  # warm-up; the materialised path is seconds long, one timed pass each
                best = min(best, *(_timed(fn, spectral) for _ in range(repeats if name == "factors" else 1)))
            res[f"{name}{'_spectral' if spectral else ''}_s"] = best
    torch.set_num_threads(default_threads)
    return res


def geometry_bench(a_dir: Path, rank: int = 16, layers: int = 2, repeats: int = 3) -> dict:
    """Cost of --spectral's update geometry (subspace_overlap, intruders) on a rank-16 PEFT-format adapter over
    the benchmark's base (7 projections x `layers` layers): mechdiag.compare with and without spectral=True, vs the
    plain way for the same modules: float64 SVDs of the base weight and of base + s*B@A."""
    import torch
    from safetensors.torch import load_file, save_file

    sys.path.insert(0, str(ROOT))
    from mechdiag.displacement import compare

    ad = WORK / "adapter"
    names = [n for n in qwen_shapes() if n.endswith("proj.weight") and int(n.split(".")[2]) < layers]
    shapes = qwen_shapes()
    if not (ad / "adapter_model.safetensors").exists():
        ad.mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1)
        tensors = {}
        for n in names:
            o, i = shapes[n]
            key = "base_model.model." + n.removesuffix(".weight")
            tensors[key + ".lora_A.weight"] = torch.randn(rank, i, generator=g) * 0.02
            tensors[key + ".lora_B.weight"] = torch.randn(o, rank, generator=g) * 0.02
        save_file(tensors, ad / "adapter_model.safetensors")
        (ad / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                            "target_modules": ["q_proj"]}))
    torch.set_num_threads(1)
    plain = [_timed(compare, a_dir, ad) for _ in range(repeats)]
    spectral = [_timed(lambda: compare(a_dir, ad, spectral=True)) for _ in range(repeats)]
    base = {}
    for p in files_of(a_dir):
        base.update({k: v for k, v in load_file(p).items() if k in names})
    fac = load_file(ad / "adapter_model.safetensors")

    def dense():
        for n in names:
            key = "base_model.model." + n.removesuffix(".weight")
            W = base[n].double()
            D = 2.0 * fac[key + ".lora_B.weight"].double() @ fac[key + ".lora_A.weight"].double()
            torch.linalg.svd(W, full_matrices=False)
            torch.linalg.svd(W + D, full_matrices=False)

    return {"n_modules": len(names), "rank": rank, "plain_s": _median(plain), "spectral_s": _median(spectral),
            "dense_svd_s": _timed(dense)}


def _timed(fn, *args) -> float:
    t0 = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t0


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


KINDS = ("floor", "floor2", "mechdiag", "hand")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--worker", nargs=3, metavar=("KIND", "A", "B"))
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (each: every case, every approach)")
    ap.add_argument("--cache", default="warm,cold", help="comma list of warm, cold")
    ap.add_argument("--no-lora", action="store_true", help="skip the LoRA / spectral part")
    ap.add_argument("--torch-path", action="store_true", help="also time the torch path (C kernel off)")
    args = ap.parse_args()
    if args.worker:
        kind, a, b = args.worker
        print(json.dumps(worker(kind, Path(a), Path(b))))
        return
    a, b = make_checkpoints()
    cases = {"sharded": (a, b), "single": make_single_files(a, b)}
    for name, (ca, cb) in cases.items():
        paths = files_of(ca, cb)
        print(f"{name}: 2 x {sum(p.stat().st_size for p in paths) / 2e9:.2f} GB bf16, {len(paths) // 2} file(s) "
              "per side")
    print(f"cpu cores {os.cpu_count()}; loadavg at start {os.getloadavg()[0]:.2f} (the machine is shared)")
    # results[cache][case][kind] = list of per-round worker results; rounds alternate cases and approaches so that
    # the machine's load falls on all of them alike
    results: dict = {}
    for cache in args.cache.split(","):
        for rnd in range(args.rounds):
            for case, (ca, cb) in cases.items():
                paths = files_of(ca, cb)
                for kind in KINDS + (("mechdiag_torch",) if args.torch_path else ()):
                    (evict if cache == "cold" else warm)(paths)
                    r = run_worker(kind, ca, cb)
                    results.setdefault(cache, {}).setdefault(case, {}).setdefault(kind, []).append(r)
                    print(f"  {cache} #{rnd + 1} {case:7s} {kind:14s} {r['seconds']:6.2f} s  peak anon "
                          f"{r['peak_anon_mb']:5.0f} MB", flush=True)
    largest_f32_mb = VOCAB * HIDDEN * 4 / 1e6
    print(f"\nlargest tensor in float32: {largest_f32_mb:.0f} MB -> memory target {largest_f32_mb + 300:.0f} MB")
    print("ratios: per round against the floor of the same round (the better of one and two threads), then the "
          "median over rounds [min-max]")
    for cache, by_case in results.items():
        for case, res in by_case.items():
            m_check, h_check = res["mechdiag"][0]["check"], res["hand"][0]["check"]
            assert all(r["kernel"] for r in res["mechdiag"]), "mechdiag ran without its C kernel"
            floors = [min(x["seconds"], y["seconds"]) for x, y in zip(res["floor"], res["floor2"], strict=True)]

            def ratio(kind, den, res=res):
                vals = [r["seconds"] / d for r, d in zip(res[kind], den, strict=True)]
                return _median(vals), min(vals), max(vals)

            hand = [r["seconds"] for r in res["hand"]]
            vf, vh = ratio("mechdiag", floors), ratio("mechdiag", hand)
            vt = ratio("mechdiag_torch", floors) if "mechdiag_torch" in res else (math.nan,) * 3
            peak = {k: max(r["peak_anon_mb"] for r in v) for k, v in res.items()}
            med = {k: _median([r["seconds"] for r in v]) for k, v in res.items()}
            cpu = {k: _median([r["cpu_seconds"] for r in v]) for k, v in res.items()}
            print(f"{cache} {case}: median s floor {_median(floors):.2f}, mechdiag {med['mechdiag']:.2f}, "
                  f"torch path {med.get('mechdiag_torch', math.nan):.2f}, hand {med['hand']:.2f} | median CPU s "
                  f"floor {cpu['floor']:.2f}, mechdiag {cpu['mechdiag']:.2f} | mechdiag/floor {vf[0]:.2f}x "
                  f"[{vf[1]:.2f}-{vf[2]:.2f}] (target <= 1.5), mechdiag/hand {vh[0]:.2f}x [{vh[1]:.2f}-{vh[2]:.2f}] "
                  f"(target <= 0.5), torch path/floor {vt[0]:.2f}x | peak anon MB: mechdiag {peak['mechdiag']:.0f}, "
                  f"hand {peak['hand']:.0f}, floor {peak['floor']:.0f} (target <= 845) | sum delta^2 mechdiag "
                  f"{m_check:.6e} hand {h_check:.6e}")
    if "warm" in results:
        warm(files_of(a, b))
        print(f"cli whole process (warm, sharded, imports included): "
              f"{min(run_cli(a, b) for _ in range(2)):.2f} s")
    if not args.no_lora:
        lb = lora_bench()
        f, m = lb["factors_s"], lb["materialised_s"]
        fs, ms = lb["factors_spectral_s"], lb["materialised_spectral_s"]
        print(f"LoRA rank {lb['rank']} on {lb['n_modules']} projections: delta_fro from factors {f * 1e3:.1f} ms vs "
              f"materialised s*B@A {m * 1e3:.1f} ms -> {m / f:.1f}x; sigma_1/stable/effective rank on "
              f"{lb['n_spectral']} modules {fs * 1e3:.1f} ms vs {ms * 1e3:.1f} ms -> {ms / fs:.1f}x (target >= 10x)")
    if not args.no_lora:
        gb = geometry_bench(a)
        extra = gb["spectral_s"] - gb["plain_s"]
        print(f"update geometry, rank-{gb['rank']} adapter on {gb['n_modules']} projections of the 0.5B-shaped base: "
              f"compare {gb['plain_s']:.2f} s, with --spectral {gb['spectral_s']:.2f} s (+{extra:.2f} s: sigma_1, "
              f"ranks, subspace_overlap, intruders) vs float64 SVDs of W and W + s*B@A {gb['dense_svd_s']:.2f} s "
              f"-> {gb['dense_svd_s'] / max(extra, 1e-9):.1f}x")
    print(f"loadavg at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()
