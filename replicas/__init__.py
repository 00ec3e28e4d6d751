"""One data-parallel replica of a model: its engine, scheduler, KV cache tiers and model."""
