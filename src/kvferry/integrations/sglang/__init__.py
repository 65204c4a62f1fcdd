"""kvferry under SGLang, two ways in (the modules named after SGLang's classes import SGLang; the others do not):

- the HiCache storage backend below SGLang's host KV pool (`hicache_storage.KvferryHiCacheStorage`), over SGLang's
  host pool pages (`host_pages`) and kvferry's cache of them (`page_store`);
- the unified-cache linker, straight from SGLang's device KV pool (`linker.KvferryLinker`), over its device pages
  (`device_pages`) and the linker's lookups, loads and offloads (`linker_store`).

Both take kvferry's settings from SGLang's extra config (`storage_settings`) and key pages alike."""
