"""The prefill worker: prompts into KV blocks, held under a pin until the decode side pulls them."""
