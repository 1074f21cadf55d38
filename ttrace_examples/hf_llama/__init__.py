"""A Hugging Face Llama as the independent reference of the megatron-gpt example's Llama (docs/porting.md)."""
