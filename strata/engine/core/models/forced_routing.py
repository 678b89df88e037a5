"""Forced MoE routing, for benchmarks only: a trace's expert ids replace the routers' top-k.

Random weights route (almost) the same experts every token, so an expert-cache benchmark
over them would measure a hit rate of 1.00. A ForcedRouting holds a device buffer `ids`
[layers, k] int32 that every SparseMoE it is attached to reads instead of its top-k: the
reference module (switch.py) and the one-token Triton router (moe_triton.router_topk, a
constexpr flag: production launches compile as before); GPT-OSS's and GLM-4.5's layers take
them in the module's own routing (SparseMoE.route). The routed weights stay the router's own
weighting of those ids: softmax probabilities renormalised as norm_topk_prob says, GPT-OSS's
softmax over the k chosen logits, GLM's sigmoid scores renormalised and scaled.

Each decode step takes the trace's next row: `before_step` (a StepHook wrapped around the
decoder's own, an expert cache's promotion) copies it into the buffer on the compute stream,
so a CUDA graph replayed after it reads it (attach and detach drop the decoder's graphs: a
graph holds the router launch it captured, forced or not); the promotion then sees the forced ids in
step_ids like any routed ones. Without a fast decoder (the CPU's plain path) a forward
pre-hook on the model does the same for each one-token forward. Prefill chunks (many tokens)
take their rows from a separate prefill trace, in order, per layer.
"""

from __future__ import annotations

from typing import Any

import torch

from strata.engine.core.models.switch import SparseMoE


def moe_layers(model: torch.nn.Module) -> dict[int, SparseMoE]:
    """layer index -> SparseMoE of the model's sparse layers (the expert store's numbering)."""
    return {i: layer.mlp for i, layer in enumerate(model.model.layers)
            if isinstance(layer.mlp, SparseMoE)}


def _checked_trace(trace: torch.Tensor, num_layers: int, top_k: int, num_experts: int,
                   what: str) -> torch.Tensor:
    trace = torch.as_tensor(trace)
    if (trace.dim() != 3 or trace.shape[1:] != (num_layers, top_k) or trace.shape[0] == 0
            or trace.dtype.is_floating_point):
        raise ValueError(f"the {what} trace must be an integer [tokens > 0, {num_layers}, "
                         f"{top_k}] array, got {trace.dtype} {tuple(trace.shape)}")
    if int(trace.min()) < 0 or int(trace.max()) >= num_experts:
        raise ValueError(f"the {what} trace's ids must be in 0..{num_experts - 1}, got "
                         f"{int(trace.min())}..{int(trace.max())}")
    ordered = trace.sort(dim=2).values
    if bool((ordered[..., 1:] == ordered[..., :-1]).any()):
        raise ValueError(f"the {what} trace routes one expert twice in a token")
    return trace.to(torch.int32).contiguous()


class ForcedLayer:
    """One SparseMoE's view of a ForcedRouting: what its router reads instead of its top-k."""

    def __init__(self, owner: ForcedRouting, layer: int):
        self.owner = owner
        self.layer = layer
        self.ids = owner.ids[layer]  # [k] int32 view: the Triton router reads it

    def rows(self, num_tokens: int) -> torch.Tensor:
        """The ids of num_tokens tokens, int64 [T, k]: the step's row for one token (a decode
        step, or a prefill's last layer, which computes the last token alone), the prefill
        trace's next rows for more (the step's row repeated when there is none)."""
        if num_tokens == 1 or self.owner.prefill_trace is None:
            return self.ids.long().expand(num_tokens, -1)
        return self.owner.prefill_rows(self.layer, num_tokens)


class ForcedRouting:
    """A decode trace [steps, layers, k] and the device buffer its rows are written into;
    a StepHook (fast/static_step.py) around `inner`. Rows cycle when the trace runs out."""

    def __init__(self, trace: Any, num_experts: int, device: torch.device,
                 inner: Any = None):
        trace = torch.as_tensor(trace)
        if trace.dim() != 3:
            raise ValueError(f"the decode trace must be [tokens, layers, k], got "
                             f"{tuple(trace.shape)}")
        num_layers, top_k = trace.shape[1], trace.shape[2]
        self.trace = _checked_trace(trace, num_layers, top_k, num_experts, "decode")
        if device.type == "cuda":
            self.trace = self.trace.pin_memory()  # rows copy without the host waiting
        self.num_experts = num_experts
        self.ids = torch.zeros(num_layers, top_k, dtype=torch.int32, device=device)
        self.inner = inner
        self.position = 0  # the next decode row
        self.prefill_trace: torch.Tensor | None = None
        self._prefill_pos: list[int] = []
        self._handles: list[Any] = []
        self._attached: list[SparseMoE] = []
        self._write(0)  # a step run before any hook (a graph's warm-up) reads a real row

    # ---- the step hook --------------------------------------------------------------------

    def _write(self, position: int) -> None:
        row = self.trace[position % self.trace.shape[0]]
        self.ids.copy_(row, non_blocking=self.ids.device.type == "cuda")

    def advance(self) -> None:
        """Write the trace's next row into `ids` (on the current stream)."""
        self._write(self.position)
        self.position += 1

    def before_step(self) -> None:
        """The inner hook's work (which may refuse the step), then the next step's row."""
        if self.inner is not None:
            self.inner.before_step()  # may refuse the step: then no row is used up
        self.advance()

    def after_step(self, num_rows: int = 1) -> None:
        if num_rows != 1:
            raise ValueError("forced routing imposes one row a step: decode one sequence")
        if self.inner is not None:
            self.inner.after_step(num_rows)

    # ---- prefill --------------------------------------------------------------------------

    def set_prefill(self, trace: Any | None) -> None:
        """Rows for the tokens of the next prefills, in order per layer (None: prefill
        chunks repeat the current decode row)."""
        if trace is None:
            self.prefill_trace = None
            return
        num_layers, top_k = self.ids.shape
        self.prefill_trace = _checked_trace(trace, num_layers, top_k, self.num_experts,
                                            "prefill")
        self._prefill_pos = [0] * num_layers

    def prefill_rows(self, layer: int, num_tokens: int) -> torch.Tensor:
        """layer's next num_tokens prefill rows, int64 [T, k] on the device (cycling)."""
        assert self.prefill_trace is not None
        start = self._prefill_pos[layer]
        self._prefill_pos[layer] = start + num_tokens
        index = torch.arange(start, start + num_tokens) % self.prefill_trace.shape[0]
        return self.prefill_trace[index, layer].to(self.ids.device, torch.long)

    # ---- attaching ------------------------------------------------------------------------

    def attach(self, model: torch.nn.Module, decoder: Any = None) -> None:
        """Make every SparseMoE of model route by this, and advance a row per decode step:
        through decoder's step hook (a GraphDecoder; this wraps its hook as `inner`), or
        without one through a forward pre-hook on each one-token model forward."""
        layers = moe_layers(model)
        num_layers, top_k = self.ids.shape
        if not layers or max(layers) >= num_layers:
            raise ValueError(f"the trace has {num_layers} layers; the model's sparse layers "
                             f"are {sorted(layers)}")
        for layer, moe in layers.items():
            if moe.top_k != top_k or moe.router.out_features != self.num_experts:
                raise ValueError(f"layer {layer} routes {moe.top_k} of "
                                 f"{moe.router.out_features} experts; the trace {top_k} of "
                                 f"{self.num_experts}")
        prefiller = getattr(decoder, "prefiller", None)
        if getattr(prefiller, "is_capturable", False):
            raise ValueError("forced routing needs a partial expert cache on the GPU: prefill "
                             "graphs over resident experts would replay the model's own routes")
        for layer, moe in layers.items():
            moe.forced = ForcedLayer(self, layer)
            self._attached.append(moe)
        if decoder is not None:
            self.inner = self._decoder_hook = decoder.step_hook
            decoder.set_step_hook(self)
            decoder.clear()  # graphs captured before launched the routers' own top-k
            self._decoder = decoder
        else:
            self._decoder = None
            self._handles.append(model.register_forward_pre_hook(self._on_forward))

    def _on_forward(self, module: torch.nn.Module, args: tuple) -> None:
        if args and isinstance(args[0], torch.Tensor) and args[0].numel() == 1:
            self.advance()

    def detach(self) -> None:
        """Give the routers and the decoder's hook back as they were."""
        for moe in self._attached:
            moe.forced = None
        self._attached.clear()
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if getattr(self, "_decoder", None) is not None:
            self._decoder.set_step_hook(self._decoder_hook)
            self._decoder.clear()  # their graphs launched the forced routers
            self._decoder = None


class TraceGuess:
    """A benchmark's guess of a layer's experts for the expert prefetch
    (fast/moe_prefetch.py) when the routing is forced: the current step's trace row for
    that layer, each id kept with probability `recall`, else replaced by an expert the
    row does not route to (seeded). A router's guess over a forced trace has nothing to
    predict, and a random model's own routes say nothing of a trained one's: this measures
    what a guess of a given recall buys."""

    def __init__(self, routing: ForcedRouting, recall: float, seed: int = 0):
        if not 0.0 <= recall <= 1.0:
            raise ValueError(f"the guess's recall must be in 0..1, not {recall}")
        self.routing = routing
        self.recall = recall
        self._generator = torch.Generator().manual_seed(seed)

    def __call__(self, layer: int, x: torch.Tensor) -> list[int]:
        routing = self.routing
        row = routing.trace[(routing.position - 1) % routing.trace.shape[0], layer].tolist()
        keep = torch.rand(len(row), generator=self._generator) < self.recall
        others = [e for e in torch.randperm(routing.num_experts, generator=self._generator)
                  .tolist() if e not in row]
        return [e if kept else others.pop() for e, kept in zip(row, keep.tolist())]
