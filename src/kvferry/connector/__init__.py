"""The connector's engine-neutral core: what any engine adapter (`kvferry.integrations.<engine>`) is built on.

- `backends`: the `Backend` interface (lookup, load, store, demote, close) and its invariants, the in-process
  backend and the key space of one registration;
- `server_link`, `server_backend`: the same interface over a `kvferry server`;
- `kv_groups`, `window_groups`, `state_groups`, `layer_parts`: backends over a hybrid model's groups (windowed
  attention, Mamba states) and over a model whose layers are stored in parts;
- `worker_backend`, `hybrid_worker`: which of those a worker builds for its KV;
- `scheduler_core`, `hybrid_scheduler`: the scheduler half: lookups, their locks, each engine step's loads and
  stores (`plan`), from neutral facts of the step (`Scheduled`, `StepFacts`);
- `plan`, `worker_side`, `counters`: one engine step's loads and stores, run on the worker;
- `engine_kv`, `settings`: the engine's KV as kvferry sees it, and the connector's settings.

Nothing here imports an engine: an adapter translates the engine's objects (its KV tensors, its scheduler's
requests) into these.
"""
