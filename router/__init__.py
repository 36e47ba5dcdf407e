"""The nanoserve router: prefix- and load-aware routing of Generation requests over engine
services. Never imports torch (its pod has none): grpc, protobuf, xxhash, tokenizers only.

Modules: `policy` (pure scoring), `prefix_index` (per-engine block hashes), `engine_pool`
(discovery, health, load, KV events), `server` (the Generation servicer and `Router`),
`cli` (`nanoserve router`)."""
