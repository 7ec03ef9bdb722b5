"""The decision service: request JSON in, Open-Jev response JSON out, over any `Backbone`.

    validate (422 on any contract violation) -> candidate budget (422) -> records -> token budget (422)
    -> candidate prompts -> chat-templated token ids -> max_length check (422, never truncated)
    -> backbone.forward(backbone.prepare(candidates, groups)) [C, H] bf16 -> fp32 head [C] -> per-question softmax(./T)
    -> answers

Admission: a request is refused before any prompt text exists when it has more candidate sequences than the candidate
budget (`candidate_budget`, default 4,096: the contract's question limit, against its 65,536-candidate limit; counted
from the question definitions as sent, before any of them is validated: `reference.request`, "Counts before
contents") or more
input tokens than the token budget (`token_budget`, default 1,048,576, 16 candidates of 16,384 tokens at 4 bytes per
token). The tokens are not counted but bounded from above: the NFC UTF-8 bytes of every candidate prompt, summed from
the records' texts (`reference.prompts.prompt_bytes`), plus the chat template's ids per candidate
(`PromptTokenizer.token_bound`), because a byte-level BPE token covers at least one byte. So a request under the token
budget never tokenizes to more than the budget, and the amplification of one shared state by thousands of candidates is
refused at the cost of validating the body. Every public JevBench task and Open-Jev example is far under both
(tests/test_service.py). One exception keeps the contract's answer to an over-length candidate: when the longest
candidate prompt alone is over the token budget (`reference.prompts.longest_prompt`: a state of megabytes), that one
prompt is tokenized (about 0.1 s for 4 MB on the 2-core development CPU), and if it is over `max_length` the 422 is
the contract's "Input length N exceeds max_length=M" with its length; over the budget by many candidates, the budget's
message stands.

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

Batching (issue 15). The work splits in two: `compile` (validation, budgets, records, prompts, token ids, max_length
check; CPU only, no backbone state, so a server's threads may run it concurrently; RequestError is that request's 422)
and `answer_many` (the forward and the readouts). `decide` is `compile` + `answer_many` of one request. For requests
1..n with C_i candidates and R_i questions, `answer_many` runs one forward over
```
candidates = cand_1 ++ cand_2 ++ ... ++ cand_n                      (C = sum C_i, request order)
groups     = g_1 ++ (g_2 + R_1) ++ ... ++ (g_n + R_1 + ... + R_{n-1})  (no two requests share a question)
hidden     = backbone.forward(backbone.prepare(candidates, groups))  [C, H] bf16
```
and request i reads rows [o_i, o_i + C_i), o_i = C_1 + ... + C_{i-1}, through its own head, softmax and answers. The
engine's tree stage then plans one two-level tree over all of them: the root is the batch's common prefix (the chat
template's first tokens, or more where requests share a state), one node per question of every request, one leaf per
candidate. Exactness: request i's response equals its response alone, bit for bit on every probability, wherever every
op of the backbone is row- and prefix-invariant (a row's bits depend only on its own path, not on the rows beside it or
how the shared prefix is split into nodes): the property that makes `tree` bitwise against `fused`. The backbone
declares it with `batch_invariant = True` (engine backbones with varlen attention, on the CPU or with row-count-
invariant GEMMs: `merged` with varlen attention in both layouts, `tree`, `graphs`); tests/test_batching.py enforces it
(hypothesis over mixes of 1-4 requests on the CPU tiny twin, the `tree` and `graphs` stages under the Triton
interpreter). Every other backbone (HF's padded batches, whose padding depends on the batch; `merged`'s masked SDPA over
all rows; a stand-in without the attribute) is answered one request per forward: forced to batch, `merged` and
`hf_torch` moved a request's probabilities by up to 7e-4 on a three-request mix (tests/test_batching.py). The head runs
per request on its own rows, so even a head kernel that depended on the row count could not couple requests.

Failure isolation: when the batch's `prepare` or `forward` raises, or returns the wrong shape, each request is
answered alone, so only a request that fails alone gets the exception, returned in its slot (any BaseException but
KeyboardInterrupt and SystemExit, which stop the process and are raised; the server answers 500). A batch too large
for the device (out of memory) thus falls back to one forward per request. A request's own readout failing (a
non-finite score) fails that request only, without a retry.

What each batched response says: `usage`, `candidate_sequences` and `answers` are the request's own; `inference_seconds`
is its own tokenization, plus the shared prepare and forward (the whole batch's), plus its own head and readout
(queueing between `compile` and `answer_many` is not counted; after a failed batch, the forward is the request's own
retry); `prefix_cache` and `graph` describe the shared forward that served it (the batch's rows, candidates and
buckets), and, only when n > 1, `metadata.batch` = {requests: n, candidate_sequences: C} says so (a lone request's keys
and their order are unchanged).

How many requests go into one forward: `batch_requests(queue, max_rows)` (a lone request always goes; see there).

Stopping a forward no client waits for: `answer_many(..., abandoned=f)` asks `f()` before the forward, before each
request's retry alone, and, on a backbone with a `layer_check` attribute (`reference.model.HFBackbone`: a pre-hook on
every decoder layer), before every layer; once it is true, the forward stops there and every request of it gets
`ForwardAbandoned` in its slot (no retry). Engine backbones have no such seam, so they stop only between forwards: the
server's admission bound (engine/serve/admission.py) keeps one forward's work bounded.
"""

from __future__ import annotations

import itertools
import os
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import torch

from reference.backbone import Backbone
from reference.prompts import Record, candidate_prompts, compile_records, longest_prompt, prompt_bytes
from reference.readout import answers, head_scores
from reference.request import Request, RequestError, parse_json_strict, validate_request
from reference.tokenizer import PromptTokenizer, default_prompt_tokenizer

REPO = Path(__file__).resolve().parents[1]
INDEPENDENT_CANDIDATES = {"enabled": False, "mode": "independent_candidates"}
DEFAULT_CANDIDATE_BUDGET = 4096
DEFAULT_TOKEN_BUDGET = 1 << 20
PROCESS_EXITS = (KeyboardInterrupt, SystemExit)  # raised through answer_many, never kept as a request's result


class ForwardAbandoned(Exception):
    """No client waits for the forward any more (the server's deadline passed, or the connection closed): it stopped
    before its end, and each of its requests gets this in its slot."""


DEFAULT_BATCH_ROWS = 8192  # rows of one batched forward on a backbone that states no `batch_max_rows`


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


@dataclass(frozen=True)
class CompiledRequest:
    """A request after `DecisionModel.compile`: its plan (token ids, groups, records) and the seconds its tokenization
    took, the first part of its `inference_seconds`."""

    plan: DecisionPlan
    tokenize_seconds: float  # from after validation and admission to the length-checked token ids

    @property
    def candidates(self) -> list[list[int]]:
        return self.plan.candidates

    @property
    def groups(self) -> list[int]:
        return self.plan.groups


def batch_inputs(batch: Sequence[CompiledRequest]) -> tuple[list[list[int]], list[int]]:
    """The backbone's input for a batch of requests: their candidates back to back, request order, and each
    candidate's question index offset by the questions of the requests before it (so no two requests share a
    question, and questions stay numbered in order of first appearance)."""
    candidates: list[list[int]] = []
    groups: list[int] = []
    offset = 0
    for one in batch:
        candidates += one.candidates
        groups += [offset + g for g in one.groups]
        offset += len(one.plan.records)
    return candidates, groups


def backbone_tensors(backbone: Backbone) -> list[torch.Tensor]:
    """The tensors an engine backbone holds (its `weights`: engine.weights.MergedWeights) once the DecisionWeights'
    backbone dict was consumed."""
    merged = getattr(backbone, "weights", None)
    if merged is None or not hasattr(merged, "named_tensors"):
        return []  # a stand-in backbone with no weights at all (e.g. bench/overhead.py): nothing to report
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

    def _admit_candidates(self, candidates: int) -> None:
        """The candidate budget, checked by `validate_request` from the declared count, before the questions."""
        if candidates > self.candidate_budget:
            raise RequestError(
                422,
                f"too many candidate sequences for the candidate budget: {candidates} "
                f"(the budget is {self.candidate_budget} per request)",
            )

    def _compile(self, request_obj: Any) -> tuple[Request, list[Record]]:
        """Validate, admit against the budgets and compile records (linear in the body: no prompt is built)."""
        request = validate_request(request_obj, model_id=self.weights.model_id, admit=self._admit_candidates)
        candidates = request.candidate_count
        records = compile_records(request)
        tokens = self.tokenizer.token_bound(prompt_bytes(records), candidates)
        if tokens > self.token_budget:
            longest_bytes, longest = longest_prompt(records)
            if self.tokenizer.token_bound(longest_bytes, 1) > self.token_budget:
                # one candidate alone is over the budget: the contract's over-length answer where it is over max_length
                length = len(self.tokenizer.encode_prompts([longest])[0])
                if length > self.max_length:
                    raise RequestError(
                        422, f"Input length {length} exceeds max_length={self.max_length}; no silent truncation"
                    )
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

    def compile(self, request_obj: Any) -> CompiledRequest:
        """All CPU work before the forward: validate, admit, compile records, build prompts, tokenize and check lengths.
        Raises RequestError (422) on any bad request; touches no backbone state, so threads may call it concurrently.
        """
        request, records = self._compile(request_obj)
        start = time.perf_counter()
        plan = self._tokenize(request, records)
        return CompiledRequest(plan, time.perf_counter() - start)

    @property
    def batch_invariant(self) -> bool:
        """Whether `answer_many` may put several requests into one forward: the backbone says its rows are batch- and
        prefix-invariant (`batch_invariant = True`), so a request's hidden states do not depend on the others."""
        return bool(getattr(self.backbone, "batch_invariant", False))

    def batch_requests(self, queue: Sequence[CompiledRequest], max_rows: int | None = None) -> int:
        """How many of the queued requests, from the front, to answer in one forward (at least 1: a lone request is
        never held back).

        The front request always goes; the next ones join in queue order (the first that does not fit ends the batch: no
        request overtakes another) while (a) the backbone is batch-invariant, (b) the rows of the batch's forward,
        `backbone.batch_rows(candidates, groups)` (the engine: the packed rows of the prefix tree over the batch's
        candidates; `graphs`: the rows of its bucket, None where the batch fits no bucket; read for every prefix of
        the queue at once through the backbone's `queue_rows`), stay within `max_rows`
        (default: the backbone's `batch_max_rows`, the largest bucket's rows on `graphs`; else `DEFAULT_BATCH_ROWS`),
        and (c) they are no more than the requests' rows when each is answered alone. (c) matters because the tree is
        two-level: requests in one batch share only their common prefix (the chat template's first tokens) as the root,
        so a request with several questions over one context would repeat that context in each question node instead of
        packing it once. A backbone without `queue_rows` is costed at the candidates' tokens (the flat layout's rows, an
        upper bound on any tree's).

        Cost: linear in the queue, and only as far as the batch reaches (`queue_rows` is lazy: each request's tokens
        are read once, each prefix's layout joined from per-request summaries; measure/batch_packing.py, `timing` in
        results/batching/batch-packing.json).
        """
        if not queue:
            raise ValueError("no queued requests")
        if len(queue) == 1 or not self.batch_invariant:
            return 1
        limit = max_rows if max_rows is not None else getattr(self.backbone, "batch_max_rows", DEFAULT_BATCH_ROWS)
        queue_rows = getattr(self.backbone, "queue_rows", None)
        if queue_rows is None:
            tokens = [sum(map(len, one.candidates)) for one in queue]
            rows = zip(tokens, itertools.accumulate(tokens))
        else:
            rows = queue_rows((one.candidates, one.groups) for one in queue)
        alone, _ = next(rows)
        for k, (own, together) in enumerate(rows, start=1):
            if alone is None or own is None or together is None or together > limit or together > alone + own:
                return k
            alone += own
        return len(queue)

    def answer_many(
        self, compiled: Sequence[CompiledRequest], *, abandoned: Callable[[], bool] | None = None
    ) -> list[dict[str, Any] | BaseException]:
        """Answer compiled requests: one `prepare` + `forward` for all of them where the backbone is batch-invariant
        (else one per request), then each request's own head, softmax and response. Returns, per request in order, its
        response dict or the exception that answering it raised (BaseException included: the caller decides; the
        server answers 500). If the batch's forward raises, every request is retried alone, so only a request that
        fails alone gets an exception.

        The batch (module docstring, "Batching"): request i's candidates follow request i-1's, its question indices
        offset by the questions before it; hidden row c of the forward is candidate c of the concatenation, and
        request i's head reads its own rows, [C_i, H], exactly the rows (and so the bits) it would read alone on a
        batch-invariant backbone (tests/test_batching.py).

        `abandoned`: asked where the forward can stop (module docstring, "Stopping a forward"); once true, the requests
        not answered yet get `ForwardAbandoned`.
        """
        abandoned = abandoned if abandoned is not None else lambda: False
        if len(compiled) > 1 and not self.batch_invariant:
            return [result for one in compiled for result in self._answer_batch([one], abandoned)]
        return self._answer_batch(compiled, abandoned)

    def _answer_batch(
        self, batch: Sequence[CompiledRequest], abandoned: Callable[[], bool]
    ) -> list[dict[str, Any] | BaseException]:
        if not batch:
            return []
        if abandoned():
            return [ForwardAbandoned() for _ in batch]
        candidates, groups = batch_inputs(batch)
        start = time.perf_counter()

        def check() -> None:
            if abandoned():
                raise ForwardAbandoned()

        layer_checks = hasattr(self.backbone, "layer_check")
        try:
            if layer_checks:
                self.backbone.layer_check = check
            with torch.no_grad():  # not inference_mode: its tensors could not be updated in place outside it later
                prepared = self.backbone.prepare(candidates, groups)
                hidden = self.backbone.forward(prepared)  # [C, hidden] bf16
            if tuple(hidden.shape) != (len(candidates), self.head_weight.shape[0]):
                raise RuntimeError(
                    f"backbone {self.backbone.name} returned hidden states of shape {tuple(hidden.shape)} for "
                    f"{len(candidates)} candidates of width {self.head_weight.shape[0]}"
                )
        except PROCESS_EXITS:
            raise  # the process is stopping: no request's fault, nothing to retry
        except ForwardAbandoned:
            return [ForwardAbandoned() for _ in batch]  # nobody waits: no retry
        except BaseException as error:  # noqa: BLE001 - returned in the request's slot (the server makes it a 500)
            if len(batch) == 1:
                return [error]
            return [result for one in batch for result in self._answer_batch([one], abandoned)]
        finally:
            if layer_checks:
                self.backbone.layer_check = None
        forward_seconds = time.perf_counter() - start
        # What describes the forward, the same for every request of the batch: computed once.
        forward = {"prefix_cache": self._prefix_cache_metadata(prepared), **self._graph_metadata(prepared)}
        if len(batch) > 1:
            forward["batch"] = {"requests": len(batch), "candidate_sequences": len(candidates)}
        results: list[dict[str, Any] | BaseException] = []
        first = 0
        for one in batch:
            rows = slice(first, first + len(one.candidates))
            first = rows.stop
            try:
                results.append(self._respond(one, hidden[rows], forward_seconds, forward))
            except PROCESS_EXITS:
                raise
            except BaseException as error:  # noqa: BLE001 - this request's own readout failed (e.g. non-finite)
                results.append(error)
        return results

    def _respond(
        self, one: CompiledRequest, hidden: torch.Tensor, forward_seconds: float, forward: dict[str, dict]
    ) -> dict[str, Any]:
        """A request's response from its own hidden rows [C_i, H] of the (possibly shared) forward; `forward`: the
        forward's `prefix_cache`, and its `graph` and `batch` where it has them (each response gets its own copy)."""
        start = time.perf_counter()
        plan = one.plan
        with torch.no_grad():
            scores = head_scores(hidden, self.head_weight, self.head_bias).cpu().tolist()  # C_i fp32 values
        result = answers(plan.records, scores, self.weights.temperature)
        inference_seconds = one.tokenize_seconds + forward_seconds + (time.perf_counter() - start)
        metadata = {
            "method": self.weights.method,
            "temperature": self.weights.temperature,
            "candidate_sequences": len(plan.candidates),
            "inference_seconds": inference_seconds,
            "prefix_cache": dict(forward["prefix_cache"]),
            "checkpoint_sha256": self.weights.checkpoint_sha256,
            "base_revision": self.weights.revision,
            "max_length": self.max_length,
            "backbone_parameter_dtypes": self.parameter_dtypes,
            "code_commit": self.code_commit,
            "backend": self.backbone.name,
            "synthetic_weights": bool(self.weights.synthetic),
            **{key: dict(forward[key]) for key in ("graph", "batch") if key in forward},
        }
        return {
            "answers": result,
            "model": self.weights.model_id,
            "usage": {"input_tokens": plan.input_tokens, "output_tokens": 0},
            "metadata": metadata,
        }

    def _prefix_cache_metadata(self, prepared: Any) -> dict:
        source = getattr(self.backbone, "prefix_cache_metadata", None)
        if source is None:
            return dict(INDEPENDENT_CANDIDATES)
        return dict(source(prepared) if callable(source) else source)

    def _graph_metadata(self, prepared: Any) -> dict:
        """`{"graph": {bucket, hit, eager_reasons}}` for a `graphs` backbone (engine/graphs.py), else nothing."""
        source = getattr(self.backbone, "graph_metadata", None)
        graph = source(prepared) if source is not None else None
        return {} if graph is None else {"graph": graph}

    def decide(self, request_obj: Any) -> dict[str, Any]:
        """The Open-Jev response object for a parsed request: `compile`, then `answer_many` of it alone (raises what
        answering it raised)."""
        result = self.answer_many([self.compile(request_obj)])[0]
        if isinstance(result, BaseException):
            raise result
        return result

    def decide_json(self, body: bytes | str) -> dict[str, Any]:
        """Strict-parse a request body, then `decide`."""
        return self.decide(parse_json_strict(body))


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
