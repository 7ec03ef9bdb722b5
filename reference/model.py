"""The "original" model: transformers' `Qwen3_5TextModel` on `DecisionWeights`, with a switchable GDN backend.

Which GDN code HF runs is decided at import: transformers 5.23 wraps `torch_chunk_gated_delta_rule`,
`torch_recurrent_gated_delta_rule`, `causal_conv1d_fn` and `causal_conv1d_update` with
`use_kernel_func_from_hub_with_fallback`, which imports `fla` / `causal_conv1d` once and, if they import, calls them
instead of the torch function (the torch function stays reachable as the wrapper's `__wrapped__`). `gdn_backend` pins
the choice for a scope by rebinding those four module globals of `modeling_qwen3_5` (the GDN layer looks them up at
call time) and restores them on exit:

* `"torch"`: HF's torch functions (the unwrapped originals), even though `fla` is installed.
* `"fla"`: FLA 0.6.0's `chunk_gated_delta_rule` (prefill) and `fused_recurrent_gated_delta_rule` (cached decode), called
  the way HF's wrapper calls them (keyword arguments FLA does not take are dropped). Dao's `causal_conv1d` is not
  installed, so the conv stays HF's torch conv: **hf_fla = HF + FLA GDN core + torch conv** (+ HF's torch gated norm,
  which 5.23 uses whether or not FLA is installed).

FLA pinning. FLA 0.6.0 can reroute `chunk_gated_delta_rule` to FlashQLA (SM90/100/120, bf16, K=V=128: exactly the
27B) or to intra-card context parallelism. Read from its source (`fla/backends.py`, `ops/gated_delta_rule/backends/
flash_qla.py`, `ops/common/backends/intracard.py`): `FLA_DISABLE_BACKEND_DISPATCH=1` is read **once, when
`fla.backends` is imported**, and makes `dispatch`/`register` return the plain Triton functions; `FLA_FLASH_QLA` and
`FLA_INTRACARD_CP` are read **at every call** by the dispatch wrapper (FlashQLA on by default, intra-card CP off by
default). This module sets `FLA_DISABLE_BACKEND_DISPATCH=1` and `FLA_FLASH_QLA=0` (unless already set) and only then
imports FLA (before `modeling_qwen3_5`, whose probe would import it too). If something imported FLA earlier, the
dispatch switch comes too late, but `FLA_FLASH_QLA=0` still holds FlashQLA off at every call; `gdn_backend("fla")`
refuses to run whenever FlashQLA or intra-card CP could still be chosen. `fla_settings()` reports the switches.

The default that the probe settles on depends on import order: FLA's package import emits an ImportWarning (flash-attn
absent); where warnings are errors (pytest here) and `modeling_qwen3_5` is imported before FLA, the probe's import
fails and HF silently binds the torch functions. Another reason to pin the backend explicitly.

On CPU, FLA's bf16 chunk kernel runs only under the Triton interpreter, which computes bf16 `tl.dot` wrongly
(reference-math.md §6), so `HFBackbone(..., "fla")` refuses a CPU device.

`HFBackbone` runs the model as Open-Jev does: consecutive candidates in batches of `batch_size`, right-padded with an
attention mask, `use_cache=False`, reading `last_hidden_state` at each candidate's last real token.
"""

from __future__ import annotations

import os
import warnings

os.environ.setdefault("FLA_DISABLE_BACKEND_DISPATCH", "1")
os.environ.setdefault("FLA_FLASH_QLA", "0")

# FLA's package import warns (ImportWarning) that flash-attn, which only FLA's own attention layers use, is absent.
# Where warnings are errors (pytest here), that warning would abort the import, and transformers' import-time probe
# would then silently settle on the torch functions; so FLA is imported here, first, with that one warning ignored.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Flash Attention is not installed", category=ImportWarning)
    import fla.backends as fla_backends  # noqa: E402
    from fla.ops import gated_delta_rule as fla_gdn  # noqa: E402

import inspect  # noqa: E402
from collections.abc import Callable, Iterator, Sequence  # noqa: E402
from contextlib import contextmanager  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import torch  # noqa: E402
from transformers.models.qwen3_5 import modeling_qwen3_5 as hf_qwen3_5  # noqa: E402

from reference.backbone import check_candidates  # noqa: E402
from reference.weights import DecisionWeights  # noqa: E402

GDN_FUNCTION_NAMES = (
    "torch_chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule",
    "causal_conv1d_fn",
    "causal_conv1d_update",
)
# HF's torch fallbacks: the functions its import-time wrappers were built around.
TORCH_GDN_FUNCTIONS: dict[str, Callable] = {
    name: inspect.unwrap(getattr(hf_qwen3_5, name)) for name in GDN_FUNCTION_NAMES
}
# The FLA 0.6.0 function (in `fla.ops.gated_delta_rule`) that replaces each HF GDN core function.
FLA_GDN_FUNCTIONS = {
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
}
BACKEND_NAMES = {"torch": "hf_torch", "fla": "hf_fla"}
PAD_TOKEN_ID = 0  # any id: right padding is causal-invisible to the real tokens (tests/test_model.py checks it)

for _name, _function in TORCH_GDN_FUNCTIONS.items():
    if _function.__module__ != hf_qwen3_5.__name__:
        raise ImportError(f"modeling_qwen3_5.{_name} does not unwrap to HF's torch function (got {_function!r})")


def fla_settings() -> dict[str, object]:
    """The FLA switches in force (for run records)."""
    return {
        "FLA_DISABLE_BACKEND_DISPATCH": os.environ.get("FLA_DISABLE_BACKEND_DISPATCH"),
        "FLA_FLASH_QLA": os.environ.get("FLA_FLASH_QLA"),
        "FLA_INTRACARD_CP": os.environ.get("FLA_INTRACARD_CP"),
        "dispatch_disabled": fla_backends._DISPATCH_DISABLED,  # what FLA read at its import
    }


def _check_fla_pinned() -> None:
    settings = fla_settings()
    if settings["dispatch_disabled"]:
        return
    if settings["FLA_FLASH_QLA"] != "0" or settings["FLA_INTRACARD_CP"] not in (None, "0"):
        raise RuntimeError(
            f"FLA backend dispatch is live and could pick FlashQLA or intra-card CP ({settings}); set FLA_FLASH_QLA=0 "
            "and leave FLA_INTRACARD_CP unset, or set FLA_DISABLE_BACKEND_DISPATCH=1 before anything imports fla"
        )


def _fla_call(fla_name: str) -> Callable:
    """FLA's function behind HF's calling convention: keyword arguments it does not declare are dropped, as HF does."""
    function = getattr(fla_gdn, fla_name)
    declared = {
        name
        for name, p in inspect.signature(function).parameters.items()
        if p.kind not in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL)
    }

    def call(*args, **kwargs):
        return function(*args, **{k: v for k, v in kwargs.items() if k in declared})

    call.fla_function = function
    return call


@contextmanager
def gdn_backend(name: str) -> Iterator[None]:
    """Run HF's GDN layers with `"torch"` (HF torch fallbacks) or `"fla"` (FLA 0.6.0 core, torch conv) in this scope."""
    if name == "torch":
        functions = dict(TORCH_GDN_FUNCTIONS)
    elif name == "fla":
        _check_fla_pinned()
        functions = dict(TORCH_GDN_FUNCTIONS) | {hf: _fla_call(fla) for hf, fla in FLA_GDN_FUNCTIONS.items()}
    else:
        raise ValueError(f"unknown GDN backend {name!r}; expected 'torch' or 'fla'")
    previous = {n: getattr(hf_qwen3_5, n) for n in GDN_FUNCTION_NAMES}
    try:
        for n, function in functions.items():
            setattr(hf_qwen3_5, n, function)
        yield
    finally:
        for n, function in previous.items():
            setattr(hf_qwen3_5, n, function)


def build_hf_model(weights: DecisionWeights) -> hf_qwen3_5.Qwen3_5TextModel:
    """`Qwen3_5TextModel` (eval, SDPA) whose parameters *are* `weights.backbone`'s tensors (assigned, not copied).

    Built on the meta device, then `load_state_dict(..., assign=True)`: every parameter keeps the stored dtype (bf16;
    fp32 A_log and gated-norm weight). The rotary buffers are not in the state dict; they are computed on the CPU, as
    transformers' own init does, and moved to the weights' device.
    """
    config = weights.shapes.to_hf_config()
    with torch.device("meta"):
        model = hf_qwen3_5.Qwen3_5TextModel(config)
    model.load_state_dict(weights.backbone, strict=True, assign=True)
    model.rotary_emb = hf_qwen3_5.Qwen3_5TextRotaryEmbedding(config).to(weights.device)
    model.eval().requires_grad_(False)
    for name, param in model.named_parameters():
        if param.data_ptr() != weights.backbone[name].data_ptr():
            raise AssertionError(f"{name} was copied instead of shared")
    on_meta = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if on_meta:
        raise AssertionError(f"left on the meta device: {on_meta}")
    if model.config._attn_implementation != "sdpa":
        raise AssertionError(f"attention implementation is {model.config._attn_implementation!r}, not sdpa")
    return model


@dataclass
class PaddedBatches:
    """Candidates in consecutive batches, right-padded; every tensor already on the device."""

    input_ids: list[torch.Tensor]  # each [B, T_max] int64, PAD_TOKEN_ID after a candidate's last token
    attention_mask: list[torch.Tensor]  # each [B, T_max] int64, 1 on real tokens
    lengths: list[torch.Tensor]  # each [B] int64, real tokens per candidate
    num_candidates: int


class HFBackbone:
    """The reference `Backbone`: HF transformers with the `torch` or `fla` GDN backend, padded per-candidate batches."""

    def __init__(self, weights: DecisionWeights, backend: str, *, batch_size: int = 32, model=None):
        if backend not in BACKEND_NAMES:
            raise ValueError(f"unknown backend {backend!r}; expected one of {sorted(BACKEND_NAMES)}")
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.name = BACKEND_NAMES[backend]
        self.backend = backend
        self.shapes = weights.shapes
        self.device = weights.device
        self.batch_size = batch_size
        if backend == "fla" and self.device.type == "cpu":
            raise ValueError(
                "the fla backend cannot run bf16 on the CPU: the Triton interpreter computes bf16 tl.dot wrongly "
                "(reference-math.md §6); use the torch backend on the CPU"
            )
        self.model = model if model is not None else build_hf_model(weights)
        # Called before every decoder layer while set (`reference.service.DecisionModel.answer_many`: it raises to stop
        # a forward no client waits for); None between forwards. A pre-hook changes no number the layer computes.
        self.layer_check: Callable[[], None] | None = None
        for layer in self.model.layers:
            layer.register_forward_pre_hook(self._before_layer)

    def _before_layer(self, module: torch.nn.Module, args: tuple) -> None:
        if self.layer_check is not None:
            self.layer_check()

    def rows_computed(self, prepared: PaddedBatches) -> int:
        """Rows the forward computes, padding included: every batch is [B, T_max] through every layer."""
        return sum(ids.numel() for ids in prepared.input_ids)

    def prepare(self, candidates: Sequence[Sequence[int]], groups: Sequence[int]) -> PaddedBatches:
        check_candidates(candidates, groups, self.shapes.vocab_size)
        batches = PaddedBatches([], [], [], len(candidates))
        for start in range(0, len(candidates), self.batch_size):
            chunk = candidates[start : start + self.batch_size]
            lengths = torch.tensor([len(ids) for ids in chunk], dtype=torch.int64)
            input_ids = torch.full((len(chunk), int(lengths.max())), PAD_TOKEN_ID, dtype=torch.int64)
            for row, ids in enumerate(chunk):
                input_ids[row, : len(ids)] = torch.tensor(ids, dtype=torch.int64)
            mask = (torch.arange(input_ids.shape[1]) < lengths[:, None]).to(torch.int64)
            batches.input_ids.append(input_ids.to(self.device))
            batches.attention_mask.append(mask.to(self.device))
            batches.lengths.append(lengths.to(self.device))
        return batches

    @torch.no_grad()
    def forward(self, prepared: PaddedBatches) -> torch.Tensor:
        """[C, hidden] bf16: `last_hidden_state` (final-norm output) at each candidate's last real token."""
        rows = []
        with gdn_backend(self.backend):
            for input_ids, mask, lengths in zip(prepared.input_ids, prepared.attention_mask, prepared.lengths):
                hidden = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state
                rows.append(hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1])  # [B, hidden]
        return torch.cat(rows)

    @torch.no_grad()
    def hidden_states(self, prepared: PaddedBatches) -> list[torch.Tensor]:
        """num_layers + 2 entries, each [total real tokens, hidden] bf16, candidates' real tokens in candidate order:
        entry 0 the embedding output, entry i the residual stream after layer i - 1, the last the final-norm output.

        HF's `output_hidden_states` gives num_layers + 1 entries and, in transformers 5.23, its last entry *is*
        `last_hidden_state` (post-norm: the last layer's own output is replaced), so the last layer's residual output
        is taken from a hook on the final norm's input.
        """
        per_entry: list[list[torch.Tensor]] = []
        pre_norm: list[torch.Tensor] = []
        hook = self.model.norm.register_forward_hook(lambda module, args, output: pre_norm.append(args[0]))
        try:
            with gdn_backend(self.backend):
                for input_ids, mask in zip(prepared.input_ids, prepared.attention_mask):
                    out = self.model(
                        input_ids=input_ids, attention_mask=mask, use_cache=False, output_hidden_states=True
                    )
                    if out.hidden_states[-1] is not out.last_hidden_state:
                        raise RuntimeError("this transformers version does not end hidden_states with the final norm")
                    entries = [*out.hidden_states[:-1], pre_norm.pop(), out.last_hidden_state]
                    real = mask.bool()
                    per_entry.append([entry[real] for entry in entries])  # [real tokens of the batch, hidden]
        finally:
            hook.remove()
        return [torch.cat(parts) for parts in zip(*per_entry)]
