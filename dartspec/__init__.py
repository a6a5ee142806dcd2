"""dartspec: fast, lossless LLM inference by speculative decoding."""
