"""vLLM's own scheduler with kvferry's connector, the model replaced by a stand-in (needs vLLM, no compiled kernel).

`SimEngine` runs the installed vLLM's ``Scheduler`` (and with it its ``KVCacheManager``) over a ``KVCacheConfig``
vLLM plans (``get_kv_cache_config_from_groups``), the connector's scheduler half made by that scheduler, and a
worker half over the per-layer views vLLM's ``allocate_kv_cache`` builds from that config, called in the order
vLLM's model runner calls it (``handle_preemptions``, ``bind_connector_metadata``, ``start_load_kv``, the forward
pass, ``wait_for_save``, ``get_finished``, ...). The stand-in model writes every full block it computes with
`reference_block` (a function of the tokens up to the block's end and the layer: what a real model's KV is) and
samples a token that depends on every token before it; before each forward pass it checks that every full block
before the request's computed tokens holds its reference bytes: every kvferry load, and every prefix vLLM reuses,
is then checked byte for byte.

Runs with the vLLM first on ``sys.path``: the tests run it for 0.32 (installed) and for 0.33 and 0.34 (their
released Python files over the installed 0.32's environment, in a child pytest: `test_vllm_releases`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

BS = 16  # vLLM's block size
NUM_BLOCKS = 96
LAYERS = 4
KV_HEADS, HEAD = 2, 64
WINDOW = 32  # the hybrid model's sliding window (layers 0 and 2)
VOCAB = 1000


def write_model(path: Path) -> str:
    """A tiny Llama's config.json (no weights: nothing runs it), enough for vLLM's ``ModelConfig``."""
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": VOCAB,
        "hidden_size": 128,
        "intermediate_size": 256,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": 4,
        "num_key_value_heads": KV_HEADS,
        "head_dim": HEAD,
        "max_position_embeddings": 4096,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    (path / "config.json").write_text(json.dumps(config))
    return str(path)


@contextlib.contextmanager
def _triton_check_passed() -> Iterator[None]:
    """vLLM 0.34's CPU platform refuses an x86 CPU without triton-cpu while it checks a config; nothing here runs a
    kernel, so that check alone is told Triton is there (vLLM's choice of model runner is left as it is)."""
    try:
        from vllm import triton_utils
    except ImportError:
        yield
        return
    had = triton_utils.HAS_TRITON
    from vllm.platforms import cpu

    check, descriptor = cpu.CpuPlatform.check_and_update_config, cpu.CpuPlatform.__dict__["check_and_update_config"]

    def patched(vllm_config: Any) -> None:
        triton_utils.HAS_TRITON = True
        try:
            check(vllm_config)
        finally:
            triton_utils.HAS_TRITON = had

    cpu.CpuPlatform.check_and_update_config = staticmethod(patched)  # type: ignore[method-assign,assignment]
    try:
        yield
    finally:
        cpu.CpuPlatform.check_and_update_config = descriptor  # type: ignore[method-assign]


def engine_config(
    model: str, extra: dict[str, Any], num_blocks: int, prefix_caching: bool, kv_events: bool = False
) -> Any:
    """vLLM's ``VllmConfig`` of an engine with kvferry's connector (``extra``: its settings; ``kv_events``: vLLM
    publishes KV events, as ``--kv-events-config '{"enable_kv_cache_events": true}'``)."""
    from vllm.config.kv_events import KVEventsConfig
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=model,
        skip_tokenizer_init=True,
        dtype="bfloat16",
        max_model_len=2048,
        enforce_eager=True,
        block_size=BS,
        enable_prefix_caching=prefix_caching,
        max_num_seqs=8,
        max_num_batched_tokens=256,  # prompts longer than this are prefilled in chunks
        num_gpu_blocks_override=num_blocks,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null") if kv_events else None,
        kv_transfer_config={
            "kv_connector": "KvferryConnector",
            "kv_connector_module_path": "kvferry.integrations.vllm",
            "kv_role": "kv_both",
            "kv_connector_extra_config": extra,
        },
    )
    with _triton_check_passed():
        return args.create_engine_config()


def kv_cache_config(vllm_config: Any, hybrid: bool, draft: str | None = None) -> Any:
    """vLLM's plan of the KV cache: one full-attention group, or (``hybrid``) sliding-window layers 0, 2 and
    full-attention layers 1, 3. ``draft``: a speculative-decoding draft model's layer besides (EAGLE and MTP name
    it after the target's last; vLLM 0.33 on marks its spec ``is_draft``), in the target's group (``"shared"``: its
    spec equals theirs, which vLLM groups together whatever ``is_draft`` says) or in one of its own (``"own"``: a
    draft with half the KV heads, each twice as wide: the same page size, another spec)."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, SlidingWindowSpec

    try:  # 0.33 moved it
        from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_config_from_groups

    common = {"block_size": BS, "num_kv_heads": KV_HEADS, "head_size": HEAD, "dtype": torch.bfloat16}
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    if hybrid:
        groups = [
            KVCacheGroupSpec(names[0::2], SlidingWindowSpec(**common, sliding_window=WINDOW)),
            KVCacheGroupSpec(names[1::2], FullAttentionSpec(**common)),
        ]
    else:
        groups = [KVCacheGroupSpec(names, FullAttentionSpec(**common))]
    draft_name = f"model.layers.{LAYERS}.self_attn.attn"
    if draft == "shared":
        groups[-1] = KVCacheGroupSpec([*groups[-1].layer_names, draft_name], groups[-1].kv_cache_spec)
    elif draft == "own":
        marked = {"is_draft": True} if "is_draft" in {f.name for f in dataclasses.fields(FullAttentionSpec)} else {}
        spec = FullAttentionSpec(**{**common, "num_kv_heads": KV_HEADS // 2, "head_size": 2 * HEAD}, **marked)
        groups.append(KVCacheGroupSpec([draft_name], spec))
    return get_kv_cache_config_from_groups(vllm_config, groups, available_memory=1 << 40)


def reference_block(tokens: list[int], layer: str, shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    """The KV a model would write for the block ending at ``tokens``' end, in ``layer``: random, fixed by both."""
    digest = hashlib.blake2b(json.dumps([layer, tokens]).encode(), digest_size=8).digest()
    generator = torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.randn(shape, generator=generator).to(dtype)


def next_token(tokens: list[int]) -> int:
    digest = hashlib.blake2b(json.dumps(tokens).encode(), digest_size=4).digest()
    return 3 + int.from_bytes(digest, "little") % (VOCAB - 3)


@dataclasses.dataclass
class StepReport:
    scheduled: dict[str, int]  # tokens scheduled per request
    computed: dict[str, int]  # computed tokens per request at the step's start
    checked_blocks: int  # blocks (per layer) checked against their reference before the forward pass
    locks_after_schedule: int  # lookup locks the connector held once vLLM scheduled the step
    preempted: list[str]  # requests vLLM preempted in the step
    resumed_with_hit: bool  # a preempted request ran again with computed tokens (kvferry's or vLLM's hit)


class _Recorder:
    """vLLM's event publisher, less the socket: each batch as a subscriber decodes it."""

    def __init__(self, published: list[Any]) -> None:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.published = published

    def publish(self, batch: Any) -> None:
        self.published.append(self._decoder.decode(self._encoder.encode(batch)))

    def shutdown(self) -> None:
        return


class SimEngine:
    """One engine: vLLM's scheduler with the connector's scheduler half, and a worker half over vLLM's views."""

    def __init__(
        self,
        model: str,
        extra: dict[str, Any],
        *,
        hybrid: bool = False,
        layout: str = "LBNHC",
        num_blocks: int = NUM_BLOCKS,
        prefix_caching: bool = True,
        kv_events: bool = False,
        draft: str | None = None,
    ) -> None:
        """``draft``: a draft model's layer besides the model's (`kv_cache_config`). ``kv_events``: vLLM's scheduler
        publishes KV events into ``published`` (each batch through vLLM's own
        msgpack encoding and ``KVEventBatch`` decoder, as a subscriber receives it)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager
        from vllm.v1.worker.utils import allocate_kv_cache

        from kvferry.integrations.vllm import KvferryConnector

        self.vllm_config = engine_config(model, extra, num_blocks, prefix_caching, kv_events)
        self.vllm_config.kv_transfer_config.engine_id = uuid.uuid4().hex  # each engine its own cache key space
        self.vllm_config.cache_config.kv_cache_layout = layout  # what vLLM's engine core resolves (as a user sets it)
        self.kv_cache_config = kv_cache_config(self.vllm_config, hybrid, draft)
        self.vllm_config.cache_config.num_gpu_blocks = self.kv_cache_config.num_blocks  # as vLLM's engine core sets it
        layout = self.vllm_config.cache_config.get_resolved_kv_cache_layout()
        groups = self.kv_cache_config.kv_cache_groups
        self.views = allocate_kv_cache(self.kv_cache_config, torch.device("cpu"), layout, [BS] * len(groups))
        for view in self.views.values():
            view.view(torch.uint8).random_()  # what an engine's blocks hold before any request (never zeros)
        self.windowed = {name for g in groups if type(g.kv_cache_spec).__name__ != "FullAttentionSpec"
                         for name in g.layer_names}  # fmt: skip
        self.group_of = {name: i for i, g in enumerate(groups) for name in g.layer_names}
        # The worker half first, as vLLM starts its workers before its scheduler: embedded mode finds its cache.
        self.worker = KvferryConnector(self.vllm_config, KVConnectorRole.WORKER, self.kv_cache_config)
        self.worker.register_kv_caches(self.views)
        self.scheduler = Scheduler(
            self.vllm_config,
            self.kv_cache_config,
            StructuredOutputManager(self.vllm_config),
            block_size=BS,
            include_finished_set=True,
        )
        self.published: list[Any] = []
        if kv_events:
            self.scheduler.kv_event_publisher = _Recorder(self.published)
        handshake = self.worker.get_handshake_metadata()
        if handshake is not None:
            self.scheduler.connector.set_xfer_handshake_metadata({0: handshake})
        from vllm.utils.hashing import get_hash_fn_by_name
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        hash_fn = get_hash_fn_by_name(self.vllm_config.cache_config.prefix_caching_hash_algo)
        init_none_hash(hash_fn)
        self._block_hasher = get_request_block_hasher(BS, hash_fn)  # as vLLM's engine core hashes requests' blocks
        self.outputs: dict[str, list[int]] = {}
        self.finished: set[str] = set()
        self._ran: set[str] = set()  # requests that ran since they (re)started: their blocks were checked then
        self._preempted: set[str] = set()  # requests vLLM preempted at some point

    # --- requests -----------------------------------------------------------------------------------------

    def add(self, req_id: str, prompt: list[int], max_tokens: int = 4) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        params.update_from_generation_config({}, None)
        self.scheduler.add_request(Request(req_id, prompt, params, None, block_hasher=self._block_hasher))
        self.outputs[req_id] = []

    @property
    def scheduler_side(self) -> Any:
        return self.scheduler.connector._scheduler

    def expected_output(self, prompt: list[int], max_tokens: int) -> list[int]:
        """What the stand-in model generates for ``prompt`` run alone."""
        tokens = list(prompt)
        for _ in range(max_tokens):
            tokens.append(next_token(tokens))
        return tokens[len(prompt) :]

    def tokens(self, req_id: str) -> list[int]:
        return list(self.scheduler.requests[req_id].all_token_ids)

    def step(self) -> StepReport:
        """One scheduler step, the stand-in model's forward pass between the connector's worker calls."""
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        out = self.scheduler.schedule()
        side = self.scheduler_side
        locks = side.locks_held() if side is not None else 0
        preempted = sorted(out.preempted_req_ids or ())
        self._ran -= set(preempted)
        self._preempted |= set(preempted)
        meta = out.kv_connector_metadata
        self.worker.handle_preemptions(meta)
        self.worker.bind_connector_metadata(meta)
        sync_loads = getattr(out, "has_sync_kv_loads", True)
        if sync_loads:
            self.worker.start_load_kv(None)  # type: ignore[arg-type]
        report = self._forward(out, locks, preempted)
        if not sync_loads:
            self.worker.start_load_kv(None)  # type: ignore[arg-type]
        self.worker.wait_for_save()
        results = self.worker.get_transfer_results(out.finished_req_ids)  # as vLLM's model runner asks
        kv_output = KVConnectorOutput(
            finished_sending=results.finished_sending,
            finished_recving=results.finished_recving,
            failed_recving=results.failed_recving,
            invalid_block_ids=self.worker.get_block_ids_with_load_errors(),
            kv_connector_stats=self.worker.get_kv_connector_stats(),
            kv_connector_worker_meta=self.worker.build_connector_worker_meta(),
        )
        self.worker.clear_connector_metadata()
        req_ids = list(out.num_scheduled_tokens)
        sampled = []
        for req_id in req_ids:
            request = self.scheduler.requests[req_id]
            done = request.num_computed_tokens >= request.num_tokens  # vLLM advanced it at schedule
            sampled.append([next_token(self.tokens(req_id))] if done else [])
        fields = {f.name for f in dataclasses.fields(ModelRunnerOutput)}
        index = {"req_id_to_index": {r: i for i, r in enumerate(req_ids)}} if "req_id_to_index" in fields else {}
        result = ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=sampled, kv_connector_output=kv_output, **index)
        for outputs in self.scheduler.update_from_output(out, result).values():
            for output in outputs.outputs:
                self.outputs[output.request_id] += output.new_token_ids
                if output.finished:
                    self.finished.add(output.request_id)
        return report

    def run(self, max_steps: int = 1000) -> list[StepReport]:
        """Steps until every request finished and the connector has nothing left in flight."""
        reports = []
        for _ in range(max_steps):
            reports.append(self.step())
            if not self.scheduler.has_requests() and not self.scheduler.requests:
                return reports
        raise AssertionError(f"requests still running after {max_steps} steps: {list(self.scheduler.requests)}")

    def shutdown(self) -> None:
        self.scheduler.shutdown()
        self.worker.shutdown()

    # --- the stand-in model ---------------------------------------------------------------------------------

    def _forward(self, out: Any, locks: int, preempted: list[str]) -> StepReport:
        """Checks the blocks a request's first step since it (re)started reads (every full block before its computed
        tokens: loaded or vLLM's prefix hit; a windowed layer's in its window), then writes the blocks its scheduled
        tokens fill."""
        manager = self.scheduler.kv_cache_manager
        computed, checked, resumed_with_hit = {}, 0, False
        for req_id, count in out.num_scheduled_tokens.items():
            request = self.scheduler.requests[req_id]
            start = request.num_computed_tokens - count  # vLLM advanced it when it scheduled the step
            computed[req_id] = start
            tokens = self.tokens(req_id)
            tables = manager.get_block_ids(req_id)
            first_run = req_id not in self._ran
            self._ran.add(req_id)
            resumed_with_hit |= first_run and req_id in self._preempted and start > 0
            for name, view in self.views.items():
                table = tables[self.group_of[name]]
                first = max(0, start - WINDOW + 1) // BS if name in self.windowed else 0
                for j in range(first, start // BS) if first_run else ():
                    want = reference_block(tokens[: (j + 1) * BS], name, view[table[j]].shape, view.dtype)
                    if not torch.equal(view[table[j]], want):
                        raise AssertionError(f"{req_id}: block {j} ({name}) does not hold its KV before step")
                    checked += 1
                for j in range(start // BS, (start + count) // BS):
                    view[table[j]] = reference_block(tokens[: (j + 1) * BS], name, view[table[j]].shape, view.dtype)
        return StepReport(dict(out.num_scheduled_tokens), computed, checked, locks, preempted, resumed_with_hit)
