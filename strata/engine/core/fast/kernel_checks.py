"""Which Triton decode kernels a decoder turns on: checked against torch at a first load, the
verdicts kept with the tuning results (issue 18 item 6).

A decoder turns on the fused decode attention and the Triton projections and norms only where
they match torch on this device (decode_attention.check_fused, decode_dense.check_kernels).
The verdicts depend on the GPU, the software, the model's shapes and dtypes and the kernels'
own source, so they are stored in the TuningStore under a key of exactly those (kind
"kernels"), and a later load with the same key reads them instead of checking on its
critical path. Any change in the key (a new driver, torch, Triton, GPU, model or kernel
source) checks again. A load that read them re-runs the checks once it is ready
(deferred_compile.py): that also loads the kernels before the first request needs them, and a
check that now fails turns its kernels off.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
from pathlib import Path

import torch

from strata.engine.core import load_phases
from strata.engine.core.fast import decode_dense, decode_rounded
from strata.engine.core.fast.decode_attention import check_fused
from strata.engine.core.fast.pointwise import PointwiseOps, attention_window
from strata.engine.core.fast.tuning_store import (
    TuningKey,
    TuningStore,
    device_identity,
    model_identity,
)
from strata.engine.core.kernels import pdl

log = logging.getLogger(__name__)

_FAST_DIR = Path(__file__).resolve().parent
# The files whose change can change a verdict: the kernels, and the torch references they
# are checked against.
_KERNEL_SOURCES = (
    _FAST_DIR / "decode_attention.py",
    _FAST_DIR / "decode_dense.py",
    _FAST_DIR / "decode_rounded.py",
    _FAST_DIR.parent / "quant" / "gemv_dp4a.py",
    _FAST_DIR / "pointwise.py",
    _FAST_DIR / "kernel_checks.py",
    _FAST_DIR.parent / "kernels" / "launch.py",
    _FAST_DIR.parent / "kernels" / "pdl.py",
)


@dataclasses.dataclass(frozen=True)
class Verdicts:
    """Per kernel family asked for: '' (matches torch here) or why not; None: not asked."""

    attention: str | None
    dense: str | None
    use_pdl: bool

    def as_json(self) -> dict:
        return dataclasses.asdict(self)


@functools.cache
def kernel_source_digest() -> str:
    """A hash of the kernels' and their references' source files."""
    digest = hashlib.blake2b(digest_size=12)
    for path in _KERNEL_SOURCES:
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def verdicts_key(model: torch.nn.Module, device: torch.device, *, fused_attention: bool,
                 dense_kernels: bool, use_pdl: bool) -> TuningKey:
    """The key of one decoder's verdicts: device and software, model, what was asked, source."""
    settings = {"fused_attention": bool(fused_attention), "dense_kernels": bool(dense_kernels),
                "use_pdl": bool(use_pdl), "kernel_source": kernel_source_digest()}
    return TuningKey(device_identity(device), model_identity(model), settings, kind="kernels")


def check(model: torch.nn.Module, device: torch.device, *, fused_attention: bool,
          dense_kernels: bool, use_pdl: bool) -> Verdicts:
    """Run the checks asked for (on this device, now)."""
    attention = dense = None
    if fused_attention:
        dtype = next(model.parameters()).dtype
        for attn in attention_kinds(model):  # each kernel variant the model compiles
            attention = check_fused(attn, dtype, device)
            if attention:
                break
    if dense_kernels:
        dense = decode_dense.check_kernels(model, use_pdl) or decode_rounded.check(model, use_pdl)
    return Verdicts(attention, dense, use_pdl)


def attention_kinds(model: torch.nn.Module) -> list:
    """One attention layer of each kind the decode kernels compile apart: a sliding window
    (Gemma 3's local layers, GPT-OSS's alternate ones) or none."""
    kinds: dict = {}
    for layer in model.model.layers:
        kinds.setdefault(attention_window(layer.self_attn), layer.self_attn)
    return list(kinds.values())


def read_stored(store: TuningStore, key: TuningKey) -> Verdicts | None:
    """The stored verdicts for key, or None (none stored, or of the wrong shape: logged)."""
    stored = store.read(key)
    if stored is None:
        return None
    settings = key.settings

    def is_verdict(value, asked: bool) -> bool:
        return isinstance(value, str) if asked else value is None

    if not (is_verdict(stored.get("attention"), settings["fused_attention"])
            and is_verdict(stored.get("dense"), settings["dense_kernels"])
            and stored.get("use_pdl") is settings["use_pdl"]):
        log.info("stored kernel checks ignored (wrong shape); checking again")
        return None
    return Verdicts(stored["attention"], stored["dense"], stored["use_pdl"])


def apply(ops: PointwiseOps, verdicts: Verdicts) -> tuple[PointwiseOps, list[str]]:
    """ops with each family that passed turned on; a note for each one left off."""
    notes = []
    if verdicts.attention is not None:
        if verdicts.attention:
            log.warning("fused decode attention off (%s); decoding with torch attention",
                        verdicts.attention)
            notes.append("torch attention")
        else:
            ops = dataclasses.replace(ops, fused_attention=True)
    if verdicts.dense is not None:
        if verdicts.dense:
            log.warning("Triton projections and norms off (%s); decoding with torch",
                        verdicts.dense)
            notes.append("torch projections")
        else:
            ops = dataclasses.replace(ops, dense_kernels=True, pdl=verdicts.use_pdl)
    return ops, notes


def decode_kernels(model: torch.nn.Module, device: torch.device, ops: PointwiseOps, *,
                   fused_attention: bool, dense_kernels: bool, store: TuningStore | None = None,
                   ) -> tuple[PointwiseOps, list[str], str]:
    """ops with the Triton decode attention and/or projection kernels turned on where asked
    and where they match torch here; a note for each one left off; and where the verdicts
    came from: "stored" (an earlier load's, nothing checked now), "checked" or "none"."""
    if not fused_attention and not dense_kernels:
        return ops, [], "none"
    use_pdl = bool(dense_kernels) and pdl.is_supported(device)
    key = verdicts_key(model, device, fused_attention=fused_attention,
                       dense_kernels=dense_kernels, use_pdl=use_pdl) if store else None
    verdicts = read_stored(store, key) if store is not None else None
    source = "stored"
    if verdicts is None:
        with load_phases.phase("check_kernels"):
            verdicts = check(model, device, fused_attention=fused_attention,
                             dense_kernels=dense_kernels, use_pdl=use_pdl)
        source = "checked"
        if store is not None:
            store.write(key, verdicts.as_json())
    ops, notes = apply(ops, verdicts)
    return ops, notes, source
