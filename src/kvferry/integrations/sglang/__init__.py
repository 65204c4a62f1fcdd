"""kvferry under SGLang: its HiCache storage backend (`hicache_storage.KvferryHiCacheStorage`, which needs SGLang),
its settings (`storage_settings`), SGLang's host pool pages (`host_pages`) and kvferry's cache of them
(`page_store`), which do not."""
