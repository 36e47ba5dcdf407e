"""What the router shares with the engines: block hashing, sampling-parameter validation,
proto conversion, tokenizer, detokenizer and TLS credentials. Torch-free; the router (and the
clients, for TLS) import nothing else of engine_service."""
