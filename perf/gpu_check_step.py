"""Training-step part of ``perf/gpu_check.py``: sync-freedom and data-path speed.

The step is the EP+CP example's (``examples/ep_cp``: ``StudentMoE`` and
``batch_loss_sums``) at ``cp = ep = 1`` on one device, fed exactly as the example
feeds it::

    offline cache (produce_cache of the frozen target's supervision)
      -> build_cached_dataloader + CachedThdCollator (pack -> process_input_for_thd, CPU)
      -> shard_thd_batch_for_cp(cp=1)        (the identity, kept so the path is the real one)
      -> attention kwargs on the CPU batch   (te_attention_kwargs / torch_varlen_kwargs,
                                              host ints and bools, non_blocking move)
      -> to_device(non_blocking=True)        (pinned by the loader on CUDA)
      -> forward / backward / clip / AdamW step

Sync-freedom (CUDA): after warm-up, one step runs under
``torch.cuda.set_sync_debug_mode("warn")`` with every warning's Python stack recorded
(the full list of offenders, each classified by the innermost repository frame), and
one under ``"error"`` (must raise exactly when the list is not empty). The same is
done for the te_thd path alone (loader -> kwargs -> device -> attention forward +
backward), which must be sync-free whatever the model does.

On the CPU (dry run) syncs cannot be observed; a dispatch-mode scan lists the ops
that *would* synchronise on CUDA (``.item()``, ``.tolist()``, ``nonzero``, boolean
indexing, ``bincount``, ``repeat_interleave`` without ``output_size``) inside the
model step -- a prediction, blind to D2H copies.
"""

from __future__ import annotations

import contextlib
import importlib.util
import math
import os
import statistics
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

REPO = Path(__file__).resolve().parents[1]


def _import_example_package(name: str) -> None:
    """Import ``examples/<name>`` as the top-level package ``name`` (the example's own
    modules, ``from ep_cp.x import ...``) without putting ``examples/`` on ``sys.path``."""
    if name in sys.modules:
        return
    root = REPO / "examples" / name
    spec = importlib.util.spec_from_file_location(
        name, root / "__init__.py", submodule_search_locations=[str(root)]
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


_import_example_package("ep_cp")

from ep_cp.config import StudentConfig, TargetConfig  # noqa: E402
from ep_cp.objective import batch_loss_sums  # noqa: E402
from ep_cp.student import StudentMoE  # noqa: E402
from ep_cp.synthetic import SyntheticTokens  # noqa: E402
from ep_cp.target import TargetTransformer  # noqa: E402

from te_thd.attention import ThdAttention, te_attention_kwargs, torch_varlen_kwargs  # noqa: E402
from te_thd.cp import shard_thd_batch_for_cp  # noqa: E402
from te_thd.offline_cache import (  # noqa: E402
    CachedTensorDataset,
    CachedThdCollator,
    build_cached_dataloader,
    produce_cache,
    to_device,
)

#: The example's cache rows (``examples/ep_cp``'s producer stores the same keys).
KEYS = ("input_ids", "seq_len", "loss_mask", "topk_logprobs", "topk_indices", "hidden")
TOKEN_KEYS = ("loss_mask", "topk_logprobs", "topk_indices", "hidden")
CACHE_NAME = "gpu_check"
SYNC_MESSAGE = "synchronizing CUDA operation"
#: offender categories that make the te_thd path (not the example model) fail
LIBRARY_PATH = ("te_thd", "data_path", "attention_path", "attention_kernel")


@dataclass
class StepPlan:
    """Sizes of the cache, the loader and the student for the step checks."""

    num_samples: int
    min_len: int
    max_len: int
    shard_size: int
    pack_seq_len: int
    batch_size: int
    topk: int
    target: dict[str, Any]
    student: dict[str, Any]
    warmup_steps: int
    timed_steps: int
    loader_workers: tuple[int, ...]  # worker counts of the throughput measurement
    step_workers: int  # workers of the loader feeding the warm-up / sync steps
    loader_batches: int
    mp_context: str | None
    bf16_autocast: bool
    seed: int = 0
    hidden_weight: float = 1.0
    aux_weight: float = 0.01
    lr: float = 1e-3


# -- cache, loader, model -----------------------------------------------------------------


def produce_example_cache(plan: StepPlan, cache_dir: str, device: torch.device) -> dict[str, Any]:
    """The example's cache (tokens, loss mask, target top-k, target hidden) via ``produce_cache``."""
    tcfg = TargetConfig(**plan.target)
    target = TargetTransformer(tcfg).to(device)
    data = SyntheticTokens(
        plan.num_samples, plan.min_len, plan.max_len, tcfg.vocab_size, seed=plan.seed
    )
    loader = DataLoader(data, batch_size=min(64, plan.shard_size), shuffle=False)

    def compute_batch(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        ids = batch["input_ids"].to(device, non_blocking=True)
        lens = batch["seq_len"].to(device, non_blocking=True)
        return target.supervision(ids, lens, plan.topk, mask_prompt=True)  # stored dtypes, CPU

    return produce_cache(
        loader,
        cache_dir,
        shard_size=plan.shard_size,
        compute_batch=compute_batch,
        keys=KEYS,
        options={"producer": "perf/gpu_check.py", "topk": plan.topk, "max_len": plan.max_len},
        cache_name=CACHE_NAME,
        producer_name="perf/gpu_check.py",
        progress=False,
    )


def make_collate(plan: StepPlan) -> CachedThdCollator:
    return CachedThdCollator(plan.pack_seq_len, length_key="seq_len", token_keys=TOKEN_KEYS)


def make_loader(
    dataset: CachedTensorDataset, plan: StepPlan, workers: int, pin: bool
) -> DataLoader:
    return build_cached_dataloader(
        dataset,
        plan.batch_size,
        True,
        make_collate(plan),
        num_workers=workers,
        seed=plan.seed,
        drop_last=True,
        pin_memory=pin,
        persistent_workers=workers > 0,
        multiprocessing_context=plan.mp_context if workers > 0 else None,
    )


def endless(loader: DataLoader) -> Iterator[dict[str, Any]]:
    """Batches across epoch ends (``persistent_workers`` keeps the workers)."""
    epoch = 0
    while True:
        loader.sampler.set_epoch(epoch)
        yield from loader
        epoch += 1


class VarlenThdAttention(nn.Module):
    """``varlen_attn(q, k, v, **torch_varlen_kwargs(thd))`` as the student's attention module.

    Used on CUDA when TE does not import (``ThdAttention`` would fall back to the
    reference, which reads boundaries on the host). Returns ``[T, H*D]`` like TE.
    """

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kw: dict[str, Any]
    ) -> torch.Tensor:
        from torch.nn.attention.varlen import varlen_attn

        # v is a strided view of the fused qkv projection; give the kernel dense tensors.
        q, k, v = (x.contiguous() for x in (q, k, v))
        return varlen_attn(q, k, v, **kw).reshape(q.shape[0], -1)


def build_model(plan: StepPlan, device: torch.device, backend: str) -> StudentMoE:
    cfg = StudentConfig(**plan.student)

    def make_attention() -> nn.Module:
        if backend == "varlen":
            return VarlenThdAttention()
        return ThdAttention(
            cfg.num_heads, cfg.head_dim, backend="te" if backend == "te" else "reference"
        )

    return StudentMoE(cfg, make_attention).to(device)


def attention_kwargs(backend: str, batch: dict[str, Any], device: torch.device) -> dict[str, Any]:
    """Kwargs built on the CPU batch (host decisions), boundaries moved non_blocking."""
    if backend == "varlen":
        return torch_varlen_kwargs(batch, device=device)
    return dict(te_attention_kwargs(batch, device=device))


def data_step(
    it: Iterator[dict[str, Any]], device: torch.device, backend: str
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Loader batch -> CP shard (cp=1) -> attention kwargs -> device."""
    batch = next(it)
    batch = shard_thd_batch_for_cp(batch, 1, 0)
    kw = attention_kwargs(backend, batch, device)
    return to_device(batch, device), kw


def _autocast(plan: StepPlan, device: torch.device) -> contextlib.AbstractContextManager:
    if plan.bf16_autocast and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def model_step(
    model: StudentMoE,
    opt: torch.optim.Optimizer,
    batch: dict[str, Any],
    kw: dict[str, Any],
    plan: StepPlan,
    device: torch.device,
) -> torch.Tensor:
    """Forward, backward, global-norm clip and AdamW step; returns the loss (detached, on device)."""
    opt.zero_grad(set_to_none=True)
    with _autocast(plan, device):
        logits, hidden_pred, aux = model(
            batch["input_ids"], batch["position_ids"], batch["padding_mask"], kw
        )
    parts = batch_loss_sums(logits, hidden_pred, batch, plan.hidden_weight)
    loss = parts.total / parts.weight.clamp(min=1.0) + plan.aux_weight * aux
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0, foreach=True)
    opt.step()
    return loss.detach()


def attention_step(
    it: Iterator[dict[str, Any]],
    device: torch.device,
    backend: str,
    heads: int,
    head_dim: int,
    attn: nn.Module,
) -> torch.Tensor:
    """The te_thd path alone: loader -> kwargs -> device -> attention forward + backward."""
    batch, kw = data_step(it, device, backend)
    t = batch["input_ids"].shape[0]
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    q, k, v = (
        torch.randn(t, heads, head_dim, device=device, dtype=dtype, requires_grad=True)
        for _ in range(3)
    )
    out = attn(q, k, v, kw)
    out.backward(torch.ones_like(out))
    return out.detach()


def make_optimizer(model: nn.Module, plan: StepPlan) -> torch.optim.Optimizer:
    # fused AdamW keeps its step counters on the device and reads none of them on the
    # host (the foreach version calls .item() on host-side counters every step).
    return torch.optim.AdamW(model.parameters(), lr=plan.lr, fused=True)


# -- sync detection -------------------------------------------------------------------------


_STAND_IN = ("te_thd/attention/reference.py", "te_thd/attention/cp_reference.py")
_OWN_FUNCS = {
    "data_step": "data_path",
    "endless": "data_path",
    "attention_kwargs": "data_path",
    "attention_step": "attention_path",
    "forward": "attention_kernel",  # VarlenThdAttention.forward: the varlen kernel call
    "model_step": "model_step",
}


def classify(stack: list[traceback.FrameSummary]) -> dict[str, str]:
    """Attribute a sync to the innermost frame inside this repository.

    Categories: ``te_thd`` (the library), ``data_path`` / ``attention_path`` /
    ``attention_kernel`` / ``model_step`` (this check's step functions; a sync in the
    backward pass surfaces at ``backward()``), ``model`` (``examples/``),
    ``cpu_stand_in`` (anything under the reference attention, which only runs where
    TE / varlen kernels do not), or ``other``.
    """
    rels: list[tuple[Path, traceback.FrameSummary]] = []
    for fr in stack:
        try:
            rel = Path(fr.filename).resolve().relative_to(REPO)
        except ValueError:
            continue
        if rel.parts[0].startswith(".") or "site-packages" in rel.parts:
            continue  # a virtual environment inside the checkout: torch, not us
        rels.append((rel, fr))
    stand_in = any(rel.as_posix() in _STAND_IN for rel, _ in rels)
    for rel, fr in reversed(rels):
        if rel.name == Path(__file__).name and fr.name in ("tolist", "__torch_dispatch__", "hook"):
            continue  # this module's instrumentation
        where = f"{rel.as_posix()}:{fr.lineno} in {fr.name}: {(fr.line or '').strip()}"
        if stand_in:
            cat = "cpu_stand_in"
        elif rel.parts[0] == "te_thd":
            cat = "te_thd"
        elif rel.parts[0] == "examples":
            cat = "model"
        elif rel.name == Path(__file__).name:
            cat = _OWN_FUNCS.get(fr.name, "other")
        else:
            cat = "other"
        return {"category": cat, "where": where}
    return {"category": "other", "where": "outside the repository"}


def _dedupe(found: list[dict[str, str]]) -> list[dict[str, Any]]:
    counts: dict[tuple[str, str, str], int] = {}
    for f in found:
        key = (f["category"], f["where"], f.get("op", ""))
        counts[key] = counts.get(key, 0) + 1
    return [
        {"category": c, "where": w, **({"op": o} if o else {}), "count": n}
        for (c, w, o), n in counts.items()
    ]


@contextlib.contextmanager
def collect_sync_warnings(found: list[dict[str, str]]) -> Iterator[list[dict[str, str]]]:
    """Append every "synchronizing CUDA operation" warning, located by :func:`classify`."""

    def hook(message, category, filename, lineno, file=None, line=None):  # noqa: ANN001
        if SYNC_MESSAGE in str(message):
            found.append(classify(traceback.extract_stack()[:-1]))

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = hook
        yield found


def cuda_sync_offenders(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run ``fn`` under ``set_sync_debug_mode("warn")``; every sync with its Python location."""
    found: list[dict[str, str]] = []
    with collect_sync_warnings(found):
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return _dedupe(found)


def cuda_sync_error_mode(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn`` under ``set_sync_debug_mode("error")``: did the first sync raise, and where."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
    except RuntimeError as exc:
        if SYNC_MESSAGE not in str(exc):
            raise
        return {"raised": True, **classify(traceback.extract_tb(exc.__traceback__))}
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    return {"raised": False}


#: aten ops that synchronise with the host when their input lives on a CUDA device.
_SYNC_OPS = {
    "aten._local_scalar_dense.default": ".item() / int() / bool() of a tensor",
    "aten.nonzero.default": "nonzero",
    "aten.masked_select.default": "masked_select",
    "aten.bincount.default": "bincount (reads max)",
    "aten.unique_consecutive.default": "unique_consecutive",
    "aten._unique2.default": "unique",
    "aten.equal.default": "torch.equal",
    "aten.is_nonzero.default": "bool(tensor)",
}


class _SyncScan(TorchDispatchMode):
    """Record ops that would synchronise on CUDA, with their Python location (CPU prediction)."""

    def __init__(self, found: list[dict[str, str]]) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        name = str(func)
        what = _SYNC_OPS.get(name)
        if name == "aten.repeat_interleave.Tensor" and kwargs.get("output_size") is None:
            what = "repeat_interleave without output_size"
        if name in ("aten.index.Tensor", "aten.index_put_.default", "aten.index_put.default"):
            idx = args[1] if len(args) > 1 else []
            if any(
                isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8) for i in idx
            ):
                what = "boolean-mask indexing (nonzero)"
        if what is not None:
            self.found.append({**classify(traceback.extract_stack()[:-1]), "op": what})
        return func(*args, **kwargs)


def predicted_sync_offenders(fn: Callable[[], Any]) -> list[dict[str, Any]]:
    """CPU prediction of the syncs ``fn`` would make on CUDA (ops above + ``Tensor.tolist``)."""
    found: list[dict[str, str]] = []
    original = torch.Tensor.tolist

    def tolist(self):  # noqa: ANN001, ANN202
        found.append({**classify(traceback.extract_stack()[:-1]), "op": ".tolist()"})
        return original(self)

    torch.Tensor.tolist = tolist  # type: ignore[method-assign]
    try:
        with _SyncScan(found):
            fn()
    finally:
        torch.Tensor.tolist = original  # type: ignore[method-assign]
    return _dedupe(found)


# -- the section ----------------------------------------------------------------------------


def host_block_probe(fn: Callable[[], Any], sleep_s: float = 2.0, runs: int = 2) -> dict[str, Any]:
    """Does ``fn`` make the host wait for the GPU, by any means?

    ``set_sync_debug_mode`` only sees syncs made through PyTorch's own helpers; a C++
    extension (TE, cuDNN) calling ``cudaStreamSynchronize`` / a blocking ``cudaMemcpy``
    is invisible to it. Here the stream is first kept busy with a ``sleep_s`` GPU
    spin (``torch.cuda._sleep``); a sync-free ``fn`` only enqueues work and returns
    long before the spin ends, a syncing one cannot return before it. Blocked = every
    run's host time exceeds 80% of the spin (a one-off stall, e.g. a first-shape
    graph build, does not count).
    """
    if not hasattr(torch.cuda, "_sleep"):
        return {"available": False}
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    probe = 50_000_000
    start.record()
    torch.cuda._sleep(probe)
    end.record()
    end.synchronize()
    cycles = int(probe * sleep_s * 1000.0 / max(start.elapsed_time(end), 1e-3))
    host: list[float] = []
    for _ in range(runs):
        torch.cuda.synchronize()
        torch.cuda._sleep(cycles)
        t0 = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return {
        "available": True,
        "gpu_spin_s": sleep_s,
        "host_s": [round(h, 4) for h in host],
        "blocked": all(h > 0.8 * sleep_s for h in host),
    }


def _sync_report(device: torch.device, fn: Callable[[], Any], label: str) -> dict[str, Any]:
    if device.type == "cuda":
        offenders = cuda_sync_offenders(fn)
        err = cuda_sync_error_mode(fn)
        consistent = err["raised"] == bool(offenders)
        probe = host_block_probe(fn)
        return {
            "how": 'torch.cuda.set_sync_debug_mode("warn") for the list, then "error"; '
            "then a host-blocking probe behind a GPU spin (catches syncs inside C++ extensions)",
            "offenders": offenders,
            "error_mode": err,
            "consistent": consistent,
            "host_block_probe": probe,
            "sync_free": not offenders and not err["raised"] and not probe.get("blocked", False),
            "label": label,
        }
    offenders = predicted_sync_offenders(fn)
    return {
        "how": "CPU prediction (dispatch scan + Tensor.tolist), not a CUDA measurement",
        "predicted_offenders": offenders,
        "label": label,
    }


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else math.nan


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _tensor_bytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.numel() * batch.element_size()
    if isinstance(batch, dict):
        return sum(_tensor_bytes(v) for v in batch.values())
    return 0


def _all_pinned(batch: dict[str, Any]) -> bool:
    return all(v.is_pinned() for v in batch.values() if isinstance(v, torch.Tensor))


def loader_throughput(
    dataset: CachedTensorDataset, plan: StepPlan, workers: int, pin: bool
) -> dict[str, Any]:
    """Batches per second from the cached loader (collate included) into (pinned) host memory."""
    loader = make_loader(dataset, plan, workers, pin)
    n = min(plan.loader_batches, len(loader) - 1)
    t0 = time.perf_counter()
    it = iter(loader)
    first = next(it)
    startup = time.perf_counter() - t0
    samples = tokens = nbytes = 0
    pinned = _all_pinned(first) if pin else None
    t1 = time.perf_counter()
    for _ in range(n):
        b = next(it)
        samples += int(b["num_samples"])
        tokens += int((~b["padding_mask"]).sum())
        nbytes += _tensor_bytes(b)
        if pin:
            pinned = pinned and _all_pinned(b)
    dt = time.perf_counter() - t1
    del it
    return {
        "workers": workers,
        "pin_memory": pin,
        "all_tensors_pinned": pinned,
        "batches": n,
        "startup_s": round(startup, 4),
        "samples_per_s": samples / dt if dt > 0 else math.nan,
        "real_tokens_per_s": tokens / dt if dt > 0 else math.nan,
        "MB_per_s": nbytes / dt / 1e6 if dt > 0 else math.nan,
        "seconds": round(dt, 4),
    }


def run_step_checks(
    plan: StepPlan, device: torch.device, backend: str, workdir: str, log: Callable[[str], None]
) -> dict[str, Any]:
    """Cache -> loader -> step: sync checks, THD + H2D share of the step, loader throughput."""
    out: dict[str, Any] = {"plan": asdict(plan), "backend": backend, "device": str(device)}
    t0 = time.perf_counter()
    cache_dir = os.path.join(workdir, "cache")
    manifest = produce_example_cache(plan, cache_dir, device)
    out["cache"] = {
        "samples": manifest["num_samples"],
        "shards": len(manifest.get("shards", [])),
        "MB": round(sum(s["bytes"] for s in manifest.get("shards", [])) / 1e6, 2),
        "seconds": round(time.perf_counter() - t0, 2),
    }
    log(f"  cache: {out['cache']}")
    dataset = CachedTensorDataset(cache_dir, CACHE_NAME, 1, KEYS)
    pin = device.type == "cuda"
    torch.manual_seed(plan.seed)
    model = build_model(plan, device, backend)
    opt = make_optimizer(model, plan)
    loader = make_loader(dataset, plan, plan.step_workers, pin)
    it = endless(loader)

    def step() -> torch.Tensor:
        batch, kw = data_step(it, device, backend)
        return model_step(model, opt, batch, kw, plan, device)

    losses = []
    for _ in range(plan.warmup_steps):  # lazy inits, kernel/graph selection, optimizer state
        losses.append(step())
    _sync(device)
    out["warmup_losses"] = [float(x) for x in losses]

    # -- sync-freedom ---------------------------------------------------------------------
    cfg = model.cfg
    attn = model.blocks[0].attn
    sync: dict[str, Any] = {}
    if device.type == "cuda":
        attention_step(it, device, backend, cfg.num_heads, cfg.head_dim, attn)  # warm the shapes
        _sync(device)
        sync["attention_path"] = _sync_report(
            device,
            lambda: attention_step(it, device, backend, cfg.num_heads, cfg.head_dim, attn),
            "loader -> kwargs -> device -> attention fwd+bwd",
        )
        sync["whole_step"] = _sync_report(
            device, step, "loader -> THD -> CP(1) -> device -> fwd/bwd/clip/AdamW"
        )
        library = [
            o
            for part in ("attention_path", "whole_step")
            for o in sync[part]["offenders"]
            if o["category"] in LIBRARY_PATH
        ]
        sync["te_thd_offenders"] = library
        sync["attention_backend_used"] = getattr(attn, "last_backend", backend)
        sync["ok"] = (
            sync["attention_path"]["sync_free"]
            and not library
            and all(sync[p]["consistent"] for p in ("attention_path", "whole_step"))
        )
    else:
        batch, kw = data_step(it, device, backend)
        sync["whole_step"] = _sync_report(
            device,
            lambda: model_step(model, opt, batch, kw, plan, device),
            "fwd/bwd/clip/AdamW (after the data step)",
        )
        sync["ok"] = None  # not measurable without CUDA
    out["sync"] = sync
    log(f"  sync: ok={sync['ok']}")

    # -- speed: THD conversion + H2D as a share of the step ---------------------------------
    collate = make_collate(plan)
    read_s, collate_s, h2d_s, h2d_bytes, step_s = [], [], [], [], []
    n_batches = len(dataset) // plan.batch_size
    for i in range(plan.timed_steps):
        j = i % n_batches
        idx = list(range(j * plan.batch_size, (j + 1) * plan.batch_size))
        ta = time.perf_counter()
        items = dataset.__getitems__(idx)
        tb = time.perf_counter()
        cpu_batch = collate(items)
        tc = time.perf_counter()
        read_s.append(tb - ta)
        collate_s.append(tc - tb)
        if pin:
            cpu_batch = {
                k: v.pin_memory() if isinstance(v, torch.Tensor) else v
                for k, v in cpu_batch.items()
            }
        _sync(device)
        td = time.perf_counter()
        kw = attention_kwargs(backend, cpu_batch, device)
        dev_batch = to_device(cpu_batch, device)
        _sync(device)
        te_ = time.perf_counter()
        h2d_s.append(te_ - td)
        h2d_bytes.append(_tensor_bytes(cpu_batch))
        losses.append(model_step(model, opt, dev_batch, kw, plan, device))
        _sync(device)
        step_s.append(time.perf_counter() - te_)
    step_med = _median(step_s)
    out["speed"] = {
        "batches": plan.timed_steps,
        "cache_read_s": _median(read_s),
        "thd_collate_s": _median(collate_s),
        "h2d_s": _median(h2d_s),
        "h2d_MB": _median([b / 1e6 for b in h2d_bytes]),
        "h2d_GB_per_s": _median(
            [b / s / 1e9 for b, s in zip(h2d_bytes, h2d_s, strict=True) if s > 0]
        ),
        "step_s": step_med,
        "thd_collate_fraction_of_step": _median(collate_s) / step_med,
        "h2d_fraction_of_step": _median(h2d_s) / step_med,
        "workers_to_hide_collate": math.ceil((_median(read_s) + _median(collate_s)) / step_med),
        "note": "collate = pack + process_input_for_thd + per-token gather (runs in loader workers, "
        "off the step's critical path when enough workers); h2d = kwargs + to_device of a pinned batch"
        if pin
        else "CPU dry run: 'h2d' is a same-device to_device (no transfer); fractions are plumbing only",
    }
    log(
        f"  speed: step {step_med * 1e3:.2f} ms, collate {out['speed']['thd_collate_fraction_of_step']:.3f}, h2d {out['speed']['h2d_fraction_of_step']:.4f} of a step"
    )

    # -- cached loader throughput into pinned memory ---------------------------------------
    it.close()  # the step loader's persistent workers go with the loader
    del loader
    out["loader"] = [loader_throughput(dataset, plan, w, pin) for w in plan.loader_workers]
    for r in out["loader"]:
        log(
            f"  loader: {r['workers']} workers, pinned={r['all_tensors_pinned']}, {r['samples_per_s']:.0f} samples/s, {r['MB_per_s']:.0f} MB/s"
        )
    out["final_loss"] = float(losses[-1])
    out["losses_finite"] = all(math.isfinite(float(x)) for x in losses)
    out["pinned_ok"] = all(r["all_tensors_pinned"] for r in out["loader"]) if pin else None
    out["seconds"] = round(time.perf_counter() - t0, 2)
    return out
