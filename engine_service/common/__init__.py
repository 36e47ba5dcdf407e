"""What the router shares with the engines: block hashing, sampling-parameter validation,
proto conversion, tokenizer and detokenizer. Torch-free; the router imports nothing else of
engine_service."""
