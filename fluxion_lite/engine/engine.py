"""The engine: requests in, tokens out, one batched model step at a time.

Continuous batching with chunked prefill: every step packs one decode token for each running sequence plus up to
`prefill_chunk` prompt tokens of sequences still in prefill into a single forward, so a long prompt never stalls the
others for its whole length. Finished sequences leave their KV in a small prefix cache; a new request that shares a
token prefix with one (the next turn of a chat) adopts it and only computes the rest.

Not thread-safe: one thread drives add_request/step/abort (the server's engine thread, or the caller of LLM).
"""
from __future__ import annotations

import itertools
import os
import uuid
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fluxion_lite.sparse import zero_copy
from fluxion_lite.model.attention import AttentionBackend, DenseAttention, SeqChunk
from fluxion_lite.model.config import ModelConfig
from fluxion_lite.errors import CapacityError, RequestError
from fluxion_lite.model.gguf_loader import load_gguf
from fluxion_lite.model.transformer import Transformer
from fluxion_lite.engine.async_decode import InFlight, chainable, queue_tokens, starts_chain
from fluxion_lite.engine.sampling import Penalties, SamplingParams, penalised, sample_rows
from fluxion_lite.sparse.auto_mode import AutoAttention, dense_tokens_for
from fluxion_lite.sparse.backend import SparseAttention
from fluxion_lite.plan.request_plan import load_planner
from fluxion_lite.plan import files as plan_files
from fluxion_lite.plan.auto_plan import choose_plan, epsilon_plan, find_labels, find_plan, plan_key
from fluxion_lite.plan.cost import plan_bytes_fraction
from fluxion_lite.plan.selector import Labels
from fluxion_lite.plan.sparse_plan import SparsePlan, with_background_override
from fluxion_lite.engine.step_counters import StepCounters
from fluxion_lite.engine.weights import AUTO, DTYPES, GGUF, resolve_device, resolve_dtype
from fluxion_lite.model.tokenizer import IncrementalDecoder, Tokenizer
from fluxion_lite.hostkv import native
from fluxion_lite.settings import Settings

# auto (the default): each request dense or fluxion by its prompt length (sparse/auto_mode.py);
# full-gpu (alias full): dense KV on the device; the rest keep all KV in host RAM (sink + window on the device):
# full-host reads everything on the CPU, fixed is the static all-CPU sparse baseline, gpu-sparse selects on the device
# and ships blocks over PCIe, fluxion runs the calibrated plan with the CPU/GPU scheduler. Same kernels throughout.
ATTENTION_MODES = ("auto", "full", "full-gpu", "full-host", "fixed", "gpu-sparse", "fluxion")
FIXED_SINK, FIXED_WINDOW = 16, 64


@dataclass
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    attention: str = ""  # how the request attended: "dense" or "fluxion" (mode auto's choice), else the mode
    epsilon: float | None = None  # the request's own error bound where it ran fluxion with one
    # finished outputs of fluxion requests: the KV fraction their plan reads per step at their final length
    # (plan/cost.plan_bytes_fraction: sink and window included); 1.0 for dense attention
    kv_read_fraction: float | None = None


@dataclass
class EngineStats:
    running: int
    waiting: int
    kv_bytes_host: int
    kv_bytes_gpu: int
    prefix_cache_bytes: int
    sparse: dict[str, float] = field(default_factory=dict)
    steps: dict[str, float] = field(default_factory=dict)  # StepCounters.as_dict(): step kinds, their time, captures


@dataclass
class Sequence:
    request_id: str
    slot: int  # the attention backend's sequence id (-1 until admitted)
    prompt_ids: list[int]
    params: SamplingParams
    decoder: IncrementalDecoder | None
    rng: torch.Generator | None
    output_ids: list[int] = field(default_factory=list)
    num_cached: int = 0  # tokens whose K/V are in the cache
    cached_tokens: int = 0  # of those, how many came from the prefix cache
    text: str = ""  # generated text so far (after stop-string truncation)
    emitted: int = 0  # characters of `text` already returned
    finish_reason: str | None = None
    all_ids: list[int] = field(default_factory=list)  # prompt + output, appended in place (no per-step concat)
    penalties: Penalties | None = None  # a penalised request's history on the model's device (sampling.Penalties)
    side: str = ""  # "dense" or "fluxion" once admitted (RequestOutput.attention)
    plan: SparsePlan | None = None  # the sparse plan it runs (its own with epsilon); None: dense attention

    def __post_init__(self) -> None:
        self.all_ids = self.prompt_ids + self.output_ids


class Engine:
    def __init__(
        self,
        model: str,
        *,
        device: str = "auto",
        dtype: str = "auto",
        attention: str = "auto",
        max_batch: int = 16,
        max_context: int | None = None,
        prefill_chunk: int = 256,
        kv_budget_bytes: int | None = None,
        prefix_cache_entries: int = 8,
        load_tokenizer: bool = True,
        predictor: bool = False,
        settings: Settings | None = None,
    ):
        """settings: every FLUXION_* knob (fluxion_lite.settings), handed to the model, the attention backend and the
        native library; None: Settings.load(), the environment now."""
        self.settings = settings if settings is not None else Settings.load()
        if attention not in ATTENTION_MODES:
            raise RequestError(f"attention={attention!r}: supported modes are {', '.join(ATTENTION_MODES)}")
        device = resolve_device(device)  # engine/weights.py: "auto" is CUDA where there is a GPU
        if device.startswith("cuda") and not torch.cuda.is_available():
            raise RequestError(f"device={device!r}: CUDA is not available on this machine")
        if dtype not in (AUTO, GGUF, *DTYPES):  # checked before the file is read
            resolve_dtype(dtype, device)
        if max_batch < 1 or prefill_chunk < 1:
            raise RequestError("max_batch and prefill_chunk must be >= 1")
        native.configure(self.settings)  # the native pool and SIMD path (process-wide), if these settings differ
        path = _resolve(model, self.settings)
        self.model_path = path
        self.model_name = model if not Path(model).suffix == ".gguf" else path.name
        # the file's blocks, memory-mapped; a named dtype dequantizes them where the model runs (on the GPU for
        # CUDA), so no fp32 copy of the model passes through host RAM on the way
        loaded = load_gguf(path, quantized=True)
        n_weights = loaded.n_weights() if dtype == AUTO and device.startswith("cuda") else None  # does bf16 fit?
        compute_dtype, quantized = resolve_dtype(dtype, device, n_weights)
        self.config = loaded.config
        self.model = Transformer(loaded, device=device, dtype=compute_dtype, settings=self.settings,
                                 quant_kernels=None if quantized else "none")
        self.tokenizer = Tokenizer(path, loaded.metadata) if load_tokenizer else None
        del loaded
        self.weights = "gguf" if quantized else str(compute_dtype).removeprefix("torch.")  # what the weights are
        self.context_length = min(max_context or self.config.context_length, self.config.context_length)
        cfg = self.config
        self.dtype, self.device = compute_dtype, torch.device(device)
        self.max_batch = max_batch
        # Opt-in: on RULER at 4K the shipped predictor's plans read half the KV of the static plan but lost most
        # retrieval tasks (docs/history.md); the calibrated static plan stays the default until that is fixed.
        self.use_predictor = predictor
        self.attn: AttentionBackend = self._make_backend(attention)
        self.attention_mode = attention
        self.kv_bytes_per_token = cfg.kv_bytes_per_token(torch.tensor([], dtype=compute_dtype).element_size())
        self.kv_budget_bytes = kv_budget_bytes
        self.max_batch, self.prefill_chunk = max_batch, prefill_chunk
        self.prefix_cache_entries = prefix_cache_entries
        self.eog_ids: frozenset[int] = self.tokenizer.eog_ids if self.tokenizer else frozenset()
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self._by_id: dict[str, Sequence] = {}
        self._prefix_cache: OrderedDict[int, list[int]] = OrderedDict()  # slot -> token ids whose KV it holds
        self._slots = itertools.count()
        self._pending_outputs: list[RequestOutput] = []
        self.step_counters = StepCounters()
        # Async decode (async_decode.py): on CUDA a pure decode batch chains its steps on the device, the host
        # reading each step's tokens while the next one runs. FLUXION_ASYNC_DECODE=0: off; on
        # the CPU it is off by default (nothing to overlap; tests turn it on to check the bookkeeping).
        wanted = self.settings.async_decode
        self.async_decode = self.device.type == "cuda" if wanted is None else wanted
        self._inflight: InFlight | None = None
        self._epsilon_plans: dict[float, SparsePlan] = {}  # a request's epsilon -> its plan (_epsilon_plan)
        self._epsilon_labels: tuple[Labels, dict[str, object]] | None = None  # _labels()

    def _make_backend(self, mode: str, plan: SparsePlan | None = None) -> AttentionBackend:
        self.plan_origin = "given by the caller" if plan is not None else None
        if mode == "auto":
            return self._auto_backend(plan)
        if mode == "fluxion" and plan is None:
            plan = self._fluxion_plan()
        attn = make_attention(mode, self.config, self.dtype, self.device, max_seqs=self.max_batch + 4,
                              model_name=self.model_name, plan=plan, per_request_plans=self.use_predictor,
                              settings=self.settings)
        if mode == "fluxion" and self.use_predictor and isinstance(attn, SparseAttention):
            # per-request plans when the model ships a predictor (models/<model>.predictor.npz); else the static plan
            attn.planner = load_planner(self.model_name, self.config, attn.plan,
                                        [lw.wo_dense() for lw in self.model.layers], self.settings)
        return attn

    def _auto_backend(self, plan: SparsePlan | None) -> AutoAttention:
        """Dense for short prompts, fluxion for long ones (sparse/auto_mode.py). The fluxion side is built now when
        its plan is at hand, else at the first long prompt (a calibration then)."""
        cfg = self.config
        dense = DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, self.dtype, self.device)
        origin = self.plan_origin
        dense_tokens = dense_tokens_for(self.device, self.settings.auto_dense_tokens)
        if plan is None and self.context_length <= dense_tokens:  # no prompt can be long enough for fluxion
            return AutoAttention(dense, lambda: self._make_backend("fluxion"), dense_tokens)  # type: ignore[arg-type,return-value]
        if plan is None:
            found, _ = find_plan(self.model_name, self.model_path, cfg, self.settings)
            if found is not None:
                plan, origin = found.plan, found.origin
        sparse = self._make_backend("fluxion", plan) if plan is not None else None
        self.plan_origin = origin
        return AutoAttention(dense, lambda: self._make_backend("fluxion"),  # type: ignore[arg-type,return-value]
                             dense_tokens, sparse)  # type: ignore[arg-type]

    def _fluxion_plan(self) -> SparsePlan:
        """The user's or the shipped plan of this model file, else one calibrated now on the loaded model
        (plan/auto_plan.py); self.plan_origin says which."""
        from fluxion_lite.plan.calibration import calibrate_loaded

        def calibrate(samples: int, context: int, positions: int, sink: int, window: int):  # type: ignore[no-untyped-def]
            if self.tokenizer is None:
                raise RequestError(f"{self.model_name}: no fluxion plan, and calibrating one needs the tokenizer "
                                   f"(load_tokenizer=True)")
            return calibrate_loaded(self.model, self.tokenizer, self.model_name, samples=samples, context=context,
                                    positions=positions, sink=sink, window=window)

        try:
            choice = choose_plan(self.model_name, self.model_path, self.config, calibrate, self.settings)
        except ValueError as e:
            raise RequestError(str(e)) from None
        self.plan_origin = choice.origin
        return choice.plan

    def set_attention(self, mode: str, plan: SparsePlan | None = None) -> None:
        """Switch the attention mode between runs on one loaded model (benchmarks compare modes this way).
        plan: a sparse plan other than the mode's default (e.g. a policy variant under test).

        Only when no request is live; the prefix cache is dropped (its KV lives in the old backend).
        """
        if mode not in ATTENTION_MODES:
            raise RequestError(f"attention={mode!r}: supported modes are {', '.join(ATTENTION_MODES)}")
        if self.running or self.waiting:
            raise RequestError("set_attention: requests are still running")
        self._sync_inflight(drop=True)
        self._prefix_cache.clear()
        self._epsilon_plans.clear()
        self._epsilon_labels = None
        if self.model.graphs is not None:  # captured steps hold the old backend's buffers (its host store too)
            self.model.graphs.release_backends()
        self.attn = None  # type: ignore[assignment]  # free the old backend's KV before the new one allocates
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.attn = self._make_backend(mode, plan)
        self.attention_mode = mode

    # ---- requests -------------------------------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
        params.validate()
        if params.epsilon is not None:
            self._check_epsilon(params.epsilon)
        if isinstance(prompt, str):
            if not prompt:
                raise RequestError("prompt is empty")
            if self.tokenizer is None:
                raise RequestError("this engine was loaded without a tokenizer: pass token ids")
            ids = self.tokenizer.encode(prompt, add_special=True)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise RequestError("prompt is empty")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise RequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.config.vocab_size})")
        n, ctx = len(ids), self.context_length
        if n >= ctx:
            raise RequestError(f"prompt has {n} tokens but the context length is {ctx} (no room to generate)")
        if n + params.max_tokens > ctx:
            raise RequestError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds the "
                f"context length {ctx}"
            )
        if isinstance(self.attn, AutoAttention) and self.attn.sparse is None and self.attn.side_for(n) == "fluxion":
            # the first long prompt builds the fluxion side (a first-use calibration) here, so that a failure is
            # this request's error rather than one inside step() that no request owns
            self.attn.fluxion()
        need = (n + params.max_tokens) * self.kv_bytes_per_token
        if self.kv_budget_bytes is not None and need > self.kv_budget_bytes:
            raise CapacityError(
                f"request needs {need / 2**20:.1f} MiB of KV ({n} + {params.max_tokens} tokens) but the KV budget is "
                f"{self.kv_budget_bytes / 2**20:.1f} MiB"
            )
        rid = request_id or f"req-{uuid.uuid4().hex[:16]}"
        if rid in self._by_id:
            raise RequestError(f"request id {rid!r} is already in use")
        rng = None
        if not params.greedy:  # on the model's device, where sampling runs (sampling.sample_rows)
            rng = torch.Generator(device=self.device)
            rng.manual_seed(params.seed if params.seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        seq = Sequence(
            request_id=rid,
            slot=-1,
            prompt_ids=ids,
            params=params,
            decoder=IncrementalDecoder(self.tokenizer) if self.tokenizer else None,
            rng=rng,
        )
        self._by_id[rid] = seq
        self.waiting.append(seq)
        return rid

    def abort(self, request_id: str) -> None:
        seq = self._by_id.pop(request_id, None)
        if seq is None:
            return
        if seq in self.waiting:
            self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        if self._inflight is not None and seq in self._inflight.seqs:  # its row is in a step still on the device
            self._sync_inflight(drop=not any(s in self.running for s in self._inflight.seqs))
        if seq.slot >= 0:
            self.attn.free(seq.slot)  # an aborted request's KV is not worth keeping: free it at once
            seq.slot = -1
        self._pending_outputs.append(self._output(seq, [], "", "abort"))

    @property
    def auto_dense_tokens(self) -> int | None:
        """Attention mode auto: the longest prompt that runs dense (sparse/auto_mode.py); None in other modes."""
        return self.attn.dense_tokens if isinstance(self.attn, AutoAttention) else None

    def explain(self) -> str:
        """The attention plan in words (per layer: streaming vs retrieval groups, g and budget)."""
        attn, head = self.attn, ""
        if isinstance(attn, AutoAttention):
            head = attn.describe() + "\n"
            if attn.sparse is None:
                return head + (f"fluxion plan: none for {self.model_name} yet; one is calibrated at the first prompt "
                               f"over {attn.dense_tokens} tokens (plan/auto_plan.py)")
            attn = attn.sparse
        if isinstance(attn, SparseAttention):
            origin = f"plan: {self.plan_origin}\n" if self.plan_origin else ""
            if attn.planner is not None:
                return head + origin + attn.planner.describe() + "\n" + attn.plan.explain()
            return head + origin + attn.plan.explain()
        return f"attention {self.attention_mode}: dense over all {self.context_length} positions"

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._pending_outputs)

    def stats(self) -> EngineStats:
        host, gpu = self.attn.bytes_used()
        cached = sum(self.attn.seq_len(s) for s in self._prefix_cache) * self.kv_bytes_per_token
        return EngineStats(len(self.running), len(self.waiting), host, gpu, cached, self.attn.stats(),
                           self.step_counters.as_dict(self.model.graphs))

    # ---- scheduling -----------------------------------------------------------------------------------------------
    def _reserved_bytes(self) -> int:
        held = sum(len(s.prompt_ids) + s.params.max_tokens for s in self.running)
        held += sum(self.attn.seq_len(slot) for slot in self._prefix_cache)
        return held * self.kv_bytes_per_token

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_batch:
            seq = self.waiting[0]
            need = (len(seq.prompt_ids) + seq.params.max_tokens) * self.kv_bytes_per_token
            while self.kv_budget_bytes is not None and self._reserved_bytes() + need > self.kv_budget_bytes:
                if not self._prefix_cache:
                    return  # wait for running requests to finish
                slot, _ = self._prefix_cache.popitem(last=False)
                self.attn.free(slot)
            self.waiting.popleft()
            self._attach_kv(seq)
            self.running.append(seq)

    def _attach_kv(self, seq: Sequence) -> None:
        """Give the sequence a KV slot, adopting the cached sequence that shares the longest token prefix."""
        best_slot, best_len = -1, 0
        n_prompt = len(seq.prompt_ids)
        for slot, ids in self._prefix_cache.items():
            if not self.attn.can_reuse(slot, n_prompt):
                continue
            common = _common_prefix(ids, seq.prompt_ids)
            if common > best_len:
                best_slot, best_len = slot, common
        if best_slot >= 0:
            del self._prefix_cache[best_slot]
            reuse = min(best_len, len(seq.prompt_ids) - 1)  # the last prompt token must run to give logits
            self.attn.truncate(best_slot, reuse)
            seq.slot, seq.num_cached, seq.cached_tokens = best_slot, reuse, reuse
            return
        seq.slot = next(self._slots)
        self.attn.allocate(seq.slot, n_prompt)
        self._place(seq)

    def _place(self, seq: Sequence) -> None:
        """Note where an admitted sequence attends and give it its own plan if it asked for an epsilon."""
        attn = self.attn
        if isinstance(attn, AutoAttention):
            sparse = attn.sparse if attn.side_of(seq.slot) == "fluxion" else None
        else:
            sparse = attn if isinstance(attn, SparseAttention) else None
        seq.side = "dense" if sparse is None else "fluxion"
        if sparse is None:
            return
        seq.plan = sparse.plan
        eps = seq.params.epsilon
        if eps is not None:
            seq.plan = self._epsilon_plan(sparse, eps)
            sparse.assign_plan(seq.slot, seq.plan)

    def _epsilon_plan(self, sparse: SparseAttention, epsilon: float) -> SparsePlan:
        """The selector's plan at this epsilon from the model's calibration labels, with the running plan's sink
        and window, shaped as plan/auto_plan.epsilon_plan says (cached per epsilon)."""
        plan = self._epsilon_plans.get(epsilon)
        if plan is None:
            found = self._labels()
            if found is None:  # add_request checked while the plan was at hand; a plan made since has labels
                raise RequestError(f"epsilon: no calibration labels for {self.model_name}")
            plan = epsilon_plan(*found, self.config, epsilon, sparse.plan.sink, sparse.plan.window)
            self._epsilon_plans[epsilon] = plan
        return plan

    def _labels(self) -> tuple[Labels, dict[str, object]] | None:
        """The model's calibration labels, read (and its file stamp checked) once per plan, not per request."""
        if self._epsilon_labels is None:
            found = find_labels(self.model_name, self.model_path, self.settings)
            if found is None:
                return None
            self._epsilon_labels = found
        return self._epsilon_labels

    def _check_epsilon(self, epsilon: float) -> None:
        """A request's epsilon needs fluxion (mode fluxion or auto), CPU selection and the model's labels."""
        attn = self.attn
        sparse = attn.sparse if isinstance(attn, AutoAttention) else attn
        if not isinstance(attn, AutoAttention) and not isinstance(attn, SparseAttention):
            raise RequestError(f"epsilon: attention mode {self.attention_mode!r} is exact; epsilon applies to modes "
                               f"auto and fluxion")
        if isinstance(sparse, SparseAttention):
            if sparse.selection != "cpu":
                raise RequestError("epsilon: this engine selects blocks on the GPU, which runs one plan for every "
                                   "request; FLUXION_SELECTION=cpu allows a plan per request")
            if self._labels() is None:
                raise RequestError(f"epsilon: {self.model_name} has no calibration labels to choose a plan from "
                                   f"(its plan is {self.plan_origin}); `fluxion-lite calibrate` makes them")
        elif self.device.type == "cuda" and self.settings.selection != "cpu":
            raise RequestError("epsilon: on CUDA a plan per request needs FLUXION_SELECTION=cpu")

    def _retire(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._by_id.pop(seq.request_id, None)
        if self.prefix_cache_entries <= 0 or not self.attn.can_reuse(seq.slot, 0):
            self.attn.free(seq.slot)
            return
        self._prefix_cache[seq.slot] = seq.all_ids[: seq.num_cached]
        while len(self._prefix_cache) > self.prefix_cache_entries:
            old, _ = self._prefix_cache.popitem(last=False)
            self.attn.free(old)

    def step(self) -> list[RequestOutput]:
        outputs, self._pending_outputs = self._pending_outputs, []
        if self._inflight is not None:
            if chainable(self._inflight, self.running, self.waiting, self.max_batch, self.context_length):
                return outputs + self._decode_async(self._inflight.seqs)
            outputs += self._land(self._sync_inflight(drop=True))
        self._admit()
        chunks: list[SeqChunk] = []
        tokens: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        budget = self.prefill_chunk
        for seq in self.running:
            ids = seq.all_ids
            pending = len(ids) - seq.num_cached
            n = 1 if pending == 1 else min(pending, budget)
            if n == 0:
                continue
            if pending > 1:
                budget -= n
            chunks.append(SeqChunk(seq.slot, seq.num_cached, n))
            tokens.extend(ids[seq.num_cached : seq.num_cached + n])
            if seq.num_cached + n == len(ids):
                logit_rows.append(len(tokens) - 1)
                sampled.append(seq)
        if not chunks:
            return outputs
        if self.async_decode and starts_chain(sampled, chunks):
            return outputs + self._decode_async(sampled)
        positions = torch.cat([torch.arange(c.start, c.start + c.length) for c in chunks])
        self.step_counters.start()
        logits = self.model.forward(
            torch.tensor(tokens), positions, chunks, self.attn, logit_rows=torch.tensor(logit_rows, dtype=torch.long)
        )  # [R, V] on the device: the tokens are chosen there (sampling.sample_rows) and only they are read back
        chosen = sample_rows(logits, self._sampling_rows(sampled, logits)).tolist() if sampled else []
        if not sampled and self.device.type == "cuda":  # the step counters time the step's device work too
            torch.cuda.current_stream(self.device).synchronize()
        self.step_counters.stop(mixed=len(tokens) != len(chunks) or len(logit_rows) != len(chunks))
        by_slot = {c.seq_id: c.length for c in chunks}
        for seq in self.running:
            seq.num_cached += by_slot.get(seq.slot, 0)
        for seq, token in zip(sampled, chosen):
            outputs.append(self._advance(seq, token))
        for seq in [s for s in sampled if s.finish_reason is not None]:
            self._retire(seq)
        return outputs

    def _sampling_rows(self, seqs: list[Sequence], logits: torch.Tensor
                       ) -> list[tuple[SamplingParams, Penalties | None, torch.Generator | None]]:
        """What sampling.sample_rows needs of each sequence (logits [R, V]); a penalised one's history goes to the
        device at its first choice (every id is on the host then: nothing is in flight before a first token)."""
        for seq in seqs:
            if seq.penalties is None and penalised(seq.params):
                seq.penalties = Penalties(seq.all_ids, len(seq.prompt_ids), logits.shape[-1], logits.device)
        return [(s.params, s.penalties, s.rng) for s in seqs]

    # ---- async decode (async_decode.py) ----------------------------------------------------------------------------
    def _decode_async(self, seqs: list[Sequence]) -> list[RequestOutput]:
        """Queue a decode step for `seqs` whose input tokens are the in-flight step's choices (else their last
        ids), then read the in-flight step's tokens while it runs on the device."""
        prev = self._inflight
        tokens = prev.tokens if prev is not None else torch.tensor([s.all_ids[s.num_cached] for s in seqs])
        chunks = [SeqChunk(s.slot, s.num_cached, 1) for s in seqs]
        self.step_counters.start()
        logits = self.model.forward(tokens, torch.tensor([c.start for c in chunks]), chunks, self.attn,
                                    defer_sync=True)  # [B, V] on the device, the step possibly still running
        for seq in seqs:
            seq.num_cached += 1
        self._inflight = queue_tokens(seqs, sample_rows(logits, self._sampling_rows(seqs, logits)))
        outputs = self._land(prev)  # none for the first step of a chain: its tokens are read by the next step()
        self.step_counters.stop(mixed=False)  # a step's share of the chain: its launch to the previous one landed
        return outputs

    def _sync_inflight(self, drop: bool) -> InFlight | None:
        """Wait for the in-flight step; drop: forget it (the caller lands it or it has no live row)."""
        inflight = self._inflight
        if inflight is not None:
            inflight.wait()
            if drop:
                self._inflight = None
        return inflight

    def _land(self, inflight: InFlight | None) -> list[RequestOutput]:
        """The tokens of a queued step for its rows that are still running; finished ones are retired, after the
        step queued behind it (which still reads their KV) is done."""
        if inflight is None:
            return []
        outputs = []
        for seq, token in zip(inflight.seqs, inflight.read()):
            if seq.finish_reason is None and seq in self.running:
                outputs.append(self._advance(seq, token))
        finished = [s for s in inflight.seqs if s.finish_reason is not None and s in self.running]
        if finished:
            self._sync_inflight(drop=not any(s.finish_reason is None for s in self.running))
            for seq in finished:
                self._retire(seq)
        return outputs

    def _advance(self, seq: Sequence, token: int) -> RequestOutput:
        """Append the sampled token to `seq`, update its text, and decide whether it is finished."""
        p = seq.params
        seq.output_ids.append(token)
        seq.all_ids.append(token)
        reason: str | None = None
        if token in self.eog_ids and not p.ignore_eos:
            reason = "stop"
        elif seq.decoder is not None:
            seq.text += seq.decoder.feed(token)
        if reason is None and p.stop:
            hit = _find_stop(seq.text, p.stop, seq.emitted)
            if hit >= 0:
                seq.text, reason = seq.text[:hit], "stop"
        if reason is None and (len(seq.output_ids) >= p.max_tokens or len(seq.all_ids) >= self.context_length):
            reason = "length"
        if reason is not None and seq.decoder is not None and reason == "length":
            seq.text += seq.decoder.flush()
        hold = 0 if reason is not None else _stop_prefix_overlap(seq.text, p.stop)
        new_text = seq.text[seq.emitted : len(seq.text) - hold]
        seq.emitted += len(new_text)
        seq.finish_reason = reason
        return self._output(seq, [token], new_text, reason)

    def _output(self, seq: Sequence, ids: list[int], text: str, reason: str | None) -> RequestOutput:
        read = None
        if reason is not None and seq.side:
            n = len(seq.all_ids)
            read = 1.0 if seq.plan is None else plan_bytes_fraction(seq.plan, n, self.config.head_dim)[0]
        own = seq.plan is not None and seq.params.epsilon is not None
        return RequestOutput(
            request_id=seq.request_id,
            new_token_ids=ids,
            new_text=text,
            finished=reason is not None,
            finish_reason=reason,
            prompt_tokens=len(seq.prompt_ids),
            completion_tokens=len(seq.output_ids),
            cached_tokens=seq.cached_tokens,
            attention=seq.side,
            epsilon=seq.params.epsilon if own else None,
            kv_read_fraction=read,
        )


def make_attention(
    mode: str, cfg: ModelConfig, dtype: torch.dtype, device: torch.device, max_seqs: int, model_name: str,
    plan: SparsePlan | None = None, per_request_plans: bool = False, selection: str | None = None,
    settings: Settings | None = None,
) -> AttentionBackend:
    """The attention backend for a mode (ATTENTION_MODES). `plan` overrides the mode's default plan;
    per_request_plans: the predictor will set plans per request (selection stays on the CPU then); selection:
    where `fluxion` selects ("cpu" or "gpu"; None: fluxion_selection decides); settings: the sparse backends'
    (None: Settings.load())."""
    settings = settings if settings is not None else Settings.load()
    if mode in ("full", "full-gpu"):
        return DenseAttention(cfg.n_layers, cfg.n_kv_heads, cfg.head_dim, dtype, device)
    if mode == "full-host":
        # every group reads all of its blocks on the CPU; g = 128 keeps the (useless) top-k scan at 1.5% of the KV
        plan = plan or SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=128, budget=1.0, sink=FIXED_SINK,
                                          window=FIXED_WINDOW)
        return SparseAttention(cfg, plan, dtype, device, max_seqs=max_seqs, placement="cpu", settings=settings)
    if mode == "fixed":
        return SparseAttention(cfg, plan or fixed_plan(cfg), dtype, device, max_seqs=max_seqs, placement="cpu",
                               settings=settings)
    if mode == "gpu-sparse":  # the baseline selects on the device in every step, mixed steps included
        return SparseAttention(cfg, plan or fixed_plan(cfg), dtype, device, max_seqs=max_seqs, placement="gpu",
                               selection="gpu", mixed_select="device", settings=settings)
    if mode == "fluxion":
        plan = plan or load_fluxion_plan(model_name, cfg, settings)
        # device_graph.py on the GPU: no round trip to the host per layer
        if (selection or fluxion_selection(device, plan, per_request_plans, settings)) == "gpu":
            return SparseAttention(cfg, plan, dtype, device, max_seqs=max_seqs, placement="gpu", selection="gpu",
                                   settings=settings)
        return SparseAttention(cfg, plan, dtype, device, max_seqs=max_seqs, placement="auto", settings=settings)
    raise RequestError(f"attention={mode!r}: supported modes are {', '.join(ATTENTION_MODES)}")


def fluxion_selection(device: torch.device, plan: SparsePlan, per_request_plans: bool,
                      settings: Settings | None = None) -> str:
    """Where `fluxion` selects blocks: the setting FLUXION_SELECTION=cpu|gpu (settings.selection; None:
    Settings.load()), or auto (the default): on the GPU when the decode
    step can run there whole (device_graph.py: a CUDA device, zero-copy reads of the host store, one retrieval
    block size, group or midrange block scoring, the static plan, no unread-background term: the captured step
    has the term too, but no GPU has run it yet), since that step needs no host round
    trip per layer (H200, llama3.1-8b shape, 32K, batch 1: ~14 ms vs ~25 ms,
    bench/results/tpot_llama3.1-8b_h200_eef3831.json); else the native top-k on the CPU."""
    settings = settings if settings is not None else Settings.load()
    choice = settings.selection  # auto, cpu or gpu (checked when the settings were parsed)
    if choice != "auto":
        return choice
    one_g = len({grp.g for layer in plan.groups for grp in layer if not grp.streaming}) <= 1
    device_scoring = (settings.topk or plan.scoring) in ("group", "native", "midrange")
    # the unread-background term: the captured device step computes it (device_background.py, g = 16) but has not
    # been run or timed on a GPU yet, and the captured CPU step with the term is what RULER measured on the H200
    # (docs/sparse.md); FLUXION_SELECTION=gpu opts in until a GPU run decides
    background = with_background_override(plan, settings).background != "off"
    if device.type != "cuda" or per_request_plans or not one_g or not device_scoring or background:
        return "cpu"
    if settings.zero_copy is False:  # FLUXION_ZERO_COPY=0: the staging path, which syncs per layer
        return "cpu"
    return "gpu" if zero_copy.check(device)[0] else "cpu"


def fixed_plan(cfg: ModelConfig) -> SparsePlan:
    """The paper's strongest hybrid baseline: every group retrieves, g = 16, 5% of the context, plus sink and window."""
    return SparsePlan.uniform(cfg.n_layers, cfg.n_kv_heads, g=16, budget=0.05, sink=FIXED_SINK, window=FIXED_WINDOW)


def load_fluxion_plan(model_name: str, cfg: ModelConfig, settings: Settings | None = None) -> SparsePlan:
    """The model's plan: the user's own (written by calibrate into the cache: settings' cache_dir, None:
    Settings.load()) first, else the shipped one."""
    path = plan_files.find(plan_key(model_name), ".plan.json", settings)
    if path is None:
        raise RequestError(
            f"attention='fluxion' needs a calibrated plan for {model_name!r} ({model_name}.plan.json in "
            f"{plan_files.user_dir(settings)} or the shipped models/); run `fluxion-lite calibrate {model_name}` "
            f"or use attention='fixed'"
        )
    plan = SparsePlan.load(path)
    plan.validate(cfg.n_layers, cfg.n_kv_heads)
    return plan


def _resolve(model: str, settings: Settings) -> Path:
    try:
        from fluxion_lite.hub.resolve import resolve_model
    except ImportError:  # catalog not present: accept only paths
        path = Path(model)
        if not path.is_file():
            from fluxion_lite.errors import UnknownModelError

            raise UnknownModelError(f"{model}: no such model file")
        return path
    return resolve_model(model, settings=settings)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _find_stop(text: str, stops: list[str], search_from: int) -> int:
    """Index where the earliest stop string starts in text (only matches that reach past already-emitted text)."""
    best = -1
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best < 0 or i < best):
            best = i
    return best


def _stop_prefix_overlap(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that is a proper prefix of some stop string (held back, not yet sent)."""
    hold = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:k]):
                hold = k
                break
    return hold
