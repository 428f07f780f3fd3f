"""The engine: EngineCore (scheduler + executor, token ids only), input/output
processing (tokenize, detokenize, stop strings) and the LLMEngine / AsyncLLM wrappers."""
