"""What the router shares with the engines: block hashing, sampling-parameter validation,
proto conversion, tokenizer, detokenizer, TLS credentials, the OpenAI HTTP front and the API
key. Torch-free; the router (and the clients, for TLS and the key) import nothing else of
engine_service."""
