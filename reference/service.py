"""The decision service: request JSON in, Open-Jev response JSON out, over any `Backbone`.

    validate (422 on any contract violation) -> candidate budget (422) -> records -> token budget (422)
    -> candidate prompts -> chat-templated token ids -> max_length check (422, never truncated)
    -> backbone.forward(backbone.prepare(candidates, groups)) [C, H] bf16 -> fp32 head [C] -> per-question softmax(./T)
    -> answers

Admission: a request is refused before any prompt text exists when it has more candidate sequences than the candidate
budget (`candidate_budget`, default 4,096: the contract's question limit, against its 65,536-candidate limit) or more
input tokens than the token budget (`token_budget`, default 1,048,576, 16 candidates of 16,384 tokens at 4 bytes per
token). The tokens are not counted but bounded from above: the NFC UTF-8 bytes of every candidate prompt, summed from
the records' texts (`reference.prompts.prompt_bytes`), plus the chat template's ids per candidate
(`PromptTokenizer.token_bound`), because a byte-level BPE token covers at least one byte. So a request under the token
budget never tokenizes to more than the budget, and the amplification of one shared state by thousands of candidates is
refused at the cost of validating the body. Every public JevBench task and Open-Jev example is far under both
(tests/test_service.py).

Response (contract §3), keys in this order: `answers` (request question order), `model` (the HF base id),
`usage` {input_tokens: real tokens summed over all candidate sequences, output_tokens: 0}, `metadata` {method,
temperature, candidate_sequences, inference_seconds, prefix_cache, checkpoint_sha256, base_revision, max_length,
backbone_parameter_dtypes, code_commit, backend, synthetic_weights}. The last two are this project's additions:
which backbone answered, and whether the weights are synthetic (then every probability is meaningless for accuracy).

`inference_seconds` runs, as in the original, from after validation to the formatted answers (tokenization, forward,
head and readout). `prefix_cache` is {"enabled": false, "mode": "independent_candidates"} unless the backbone has a
`prefix_cache_metadata` attribute: a dict, or a callable taking the prepared input and returning one.
The over-length message reports the longest candidate of the request (the original reports the longest of the first
over-length batch of `batch_size` candidates: the same number whenever the request fits one batch, 32 by default).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from reference.backbone import Backbone
from reference.prompts import Record, candidate_prompts, compile_records, prompt_bytes
from reference.readout import answers, head_scores
from reference.request import Request, RequestError, parse_json_strict, validate_request
from reference.tokenizer import PromptTokenizer, default_prompt_tokenizer

REPO = Path(__file__).resolve().parents[1]
INDEPENDENT_CANDIDATES = {"enabled": False, "mode": "independent_candidates"}
DEFAULT_CANDIDATE_BUDGET = 4096
DEFAULT_TOKEN_BUDGET = 1 << 20


def git_commit(repo: Path = REPO) -> str | None:
    """The commit of the code at `repo` (the response's `code_commit`): `JEVLAB_GIT_COMMIT` where the sender of a copy
    set it, else HEAD where `repo` is itself a git checkout's top level, else None (a copy placed inside another
    repository has no commit of its own). The same rule as `ablations.envinfo.git_state`."""
    if os.environ.get("JEVLAB_GIT_COMMIT"):
        return os.environ["JEVLAB_GIT_COMMIT"]

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(
                ["git", "-C", str(repo), *args], capture_output=True, text=True, check=True, timeout=10
            )
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() or None

    top = git("rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != Path(repo).resolve():
        return None
    return git("rev-parse", "HEAD")


@dataclass(frozen=True)
class DecisionPlan:
    """Everything before the forward: the validated request and what the backbone gets."""

    request: Request
    records: list[Record]
    prompts: list[str]  # user-message contents, candidate order (records' candidates back to back)
    candidates: list[list[int]]  # chat-templated token ids, candidate order
    groups: list[int]  # groups[c] = index of the record (question) candidate c belongs to

    @property
    def input_tokens(self) -> int:
        return sum(len(ids) for ids in self.candidates)


def backbone_tensors(backbone: Backbone) -> list[torch.Tensor]:
    """The tensors an engine backbone holds (its `weights`: engine.weights.MergedWeights) once the DecisionWeights'
    backbone dict was consumed."""
    merged = getattr(backbone, "weights", None)
    if merged is None or not hasattr(merged, "named_tensors"):
        return []  # a stand-in backbone with no weights at all (e.g. ablations/overhead.py): nothing to report
    return [tensor for _, tensor in merged.named_tensors()]


def prompts_and_groups(records: list[Record]) -> tuple[list[str], list[int]]:
    """Every candidate's user-message text, records in order, and the index of the record each belongs to."""
    prompts, groups = [], []
    for index, record in enumerate(records):
        own = candidate_prompts(record)
        prompts += own
        groups += [index] * len(own)
    return prompts, groups


def request_candidates(
    request_obj: Any, *, model_id: str = "Qwen/Qwen3.8-27B", tokenizer: PromptTokenizer | None = None
) -> tuple[list[list[int]], list[int]]:
    """Token ids and question index of every candidate of a request: validation, prompts and chat template, the
    steps `DecisionModel.plan` takes, without a model (no length limit applied)."""
    prompts, groups = prompts_and_groups(compile_records(validate_request(request_obj, model_id=model_id)))
    return (tokenizer or default_prompt_tokenizer()).encode_prompts(prompts), groups


class DecisionModel:
    """A backbone plus the decision weights' head and temperature, behind the Open-Jev request contract."""

    def __init__(
        self,
        backbone: Backbone,
        weights: Any,  # reference.weights.DecisionWeights
        *,
        tokenizer: PromptTokenizer | None = None,
        max_length: int | None = None,
        candidate_budget: int = DEFAULT_CANDIDATE_BUDGET,
        token_budget: int = DEFAULT_TOKEN_BUDGET,
        code_commit: str | None = None,
    ) -> None:
        self.backbone = backbone
        self.weights = weights
        self.tokenizer = tokenizer if tokenizer is not None else default_prompt_tokenizer()
        self.max_length = int(weights.max_length if max_length is None else max_length)
        if self.max_length < 1:
            raise ValueError(f"max_length must be positive, got {self.max_length}")
        if candidate_budget < 1 or token_budget < 1:
            raise ValueError(f"budgets must be positive, got candidates {candidate_budget}, tokens {token_budget}")
        self.candidate_budget = candidate_budget
        self.token_budget = token_budget
        self.code_commit = code_commit if code_commit is not None else git_commit()
        self.head_weight = weights.head_weight.to(device=backbone.device)  # fp32 [hidden]
        self.head_bias = weights.head_bias.to(device=backbone.device)  # fp32 []
        # An engine backbone consumes weights.backbone into its own merged tensors; read the dtypes where they live.
        tensors = weights.backbone.values() if weights.backbone else backbone_tensors(backbone)
        self.parameter_dtypes = sorted({str(tensor.dtype) for tensor in tensors})

    def _compile(self, request_obj: Any) -> tuple[Request, list[Record]]:
        """Validate, admit against the budgets and compile records (linear in the body: no prompt is built)."""
        request = validate_request(request_obj, model_id=self.weights.model_id)
        candidates = request.candidate_count
        if candidates > self.candidate_budget:
            raise RequestError(
                422,
                f"too many candidate sequences for the candidate budget: {candidates} "
                f"(the budget is {self.candidate_budget} per request)",
            )
        records = compile_records(request)
        tokens = self.tokenizer.token_bound(prompt_bytes(records), candidates)
        if tokens > self.token_budget:
            raise RequestError(
                422,
                f"too many input tokens for the token budget: up to {tokens} estimated from {candidates} candidate "
                f"sequences (the budget is {self.token_budget} per request)",
            )
        return request, records

    def _tokenize(self, request: Request, records: list[Record]) -> DecisionPlan:
        prompts, groups = prompts_and_groups(records)
        candidates = self.tokenizer.encode_prompts(prompts)
        longest = max(len(ids) for ids in candidates)
        if longest > self.max_length:
            raise RequestError(
                422, f"Input length {longest} exceeds max_length={self.max_length}; no silent truncation"
            )
        return DecisionPlan(request, records, prompts, candidates, groups)

    def plan(self, request_obj: Any) -> DecisionPlan:
        """Validate, admit, compile, tokenize and check lengths; raises RequestError (422) on any bad request."""
        return self._tokenize(*self._compile(request_obj))

    def _prefix_cache_metadata(self, prepared: Any) -> dict:
        source = getattr(self.backbone, "prefix_cache_metadata", None)
        if source is None:
            return dict(INDEPENDENT_CANDIDATES)
        return dict(source(prepared) if callable(source) else source)

    def decide(self, request_obj: Any) -> dict[str, Any]:
        """The Open-Jev response object for a parsed request."""
        request, records = self._compile(request_obj)
        start = time.perf_counter()
        plan = self._tokenize(request, records)
        with torch.no_grad():  # not inference_mode: its tensors could not be updated in place outside it later
            prepared = self.backbone.prepare(plan.candidates, plan.groups)
            hidden = self.backbone.forward(prepared)  # [C, hidden] bf16
            if tuple(hidden.shape) != (len(plan.candidates), self.head_weight.shape[0]):
                raise RuntimeError(
                    f"backbone {self.backbone.name} returned hidden states of shape {tuple(hidden.shape)} for "
                    f"{len(plan.candidates)} candidates of width {self.head_weight.shape[0]}"
                )
            scores = head_scores(hidden, self.head_weight, self.head_bias).cpu().tolist()  # C fp32 values
        result = answers(records, scores, self.weights.temperature)
        inference_seconds = time.perf_counter() - start
        return {
            "answers": result,
            "model": self.weights.model_id,
            "usage": {"input_tokens": plan.input_tokens, "output_tokens": 0},
            "metadata": {
                "method": self.weights.method,
                "temperature": self.weights.temperature,
                "candidate_sequences": len(plan.candidates),
                "inference_seconds": inference_seconds,
                "prefix_cache": self._prefix_cache_metadata(prepared),
                "checkpoint_sha256": self.weights.checkpoint_sha256,
                "base_revision": self.weights.revision,
                "max_length": self.max_length,
                "backbone_parameter_dtypes": self.parameter_dtypes,
                "code_commit": self.code_commit,
                "backend": self.backbone.name,
                "synthetic_weights": bool(self.weights.synthetic),
                **self._graph_metadata(prepared),
            },
        }

    def _graph_metadata(self, prepared: Any) -> dict:
        """`{"graph": {bucket, hit, eager_reasons}}` for a `graphs` backbone (engine/graphs.py), else nothing."""
        source = getattr(self.backbone, "graph_metadata", None)
        graph = source(prepared) if source is not None else None
        return {} if graph is None else {"graph": graph}

    def decide_json(self, body: bytes | str) -> dict[str, Any]:
        """Strict-parse a request body, then `decide`."""
        return self.decide(parse_json_strict(body))


@cache
@cache
def default_model() -> DecisionModel:
    """The tiny twin with seeded synthetic weights on the HF torch path, on the CPU (built on first use).

    Synthetic weights: the probabilities it returns exercise the numerics path and carry no meaning for accuracy.
    """
    from reference.model import HFBackbone
    from reference.shapes import TINY
    from reference.weights import synthetic_weights

    weights = synthetic_weights(TINY, seed=0, device="cpu")
    return DecisionModel(HFBackbone(weights, "torch"), weights)


def decide(request_obj: Any) -> dict[str, Any]:
    """Answer one parsed request with `default_model()` (synthetic weights: see there)."""
    return default_model().decide(request_obj)
