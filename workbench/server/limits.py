"""The server's per-request limits: each default written once, for `create_app`,
`serve` and `workbench serve` (this module imports nothing, so the CLI stays light).

None for a limit (0 on the command line) lifts it.
"""

# engine calls at once: an LLM decodes these together, one forward pass per token (its
# `max_batch`, 8 by default); further requests wait in the queue
MAX_CONCURRENT = 8
MAX_BODY_BYTES = 25 * 1024 * 1024  # OpenAI's limit for audio uploads; more gets 413
# The longest answer a model loaded with the default context (kv_cache_size=4096) can
# give at all, so the cap never cuts what such a model would say; it stops a request
# from asking a bigger-context or remote model for 100k tokens. Time is bounded apart.
MAX_TOKENS_LIMIT = 4096
REQUEST_TIMEOUT = 600.0  # seconds from a request's body to its answer's last byte; then 504
# seconds a client has for its whole request body (408 after): a 25 MiB upload needs
# 0.2 MB/s; a stalled client holds a connection this long, never an engine slot
BODY_TIMEOUT = 120.0
MAX_AUDIO_SECONDS = 3600.0  # the longest audio one transcription request may carry; then 400
# tokens one embeddings request may hold in all, its texts counted as the model cuts them
# (OpenAI's limit, with its 2048 inputs per request in the schema); more gets 400 before
# any forward pass. At MiniLM's ~2,300 tokens/s on two CPU cores that is ~2 minutes.
MAX_EMBEDDING_TOKENS = 300_000
# open connections at once (lowered to fit the process's file-descriptor limit); past it
# the connection longest waiting for its headers is closed, or, all busy, the new one: 503
MAX_CONNECTIONS = 1024
# seconds a connection has to send a request's headers (from opening, or from its last
# answer when kept alive); then 408: half-open sockets cannot pile up
HEADER_TIMEOUT = 10.0
