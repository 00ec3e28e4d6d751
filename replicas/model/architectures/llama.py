"""Llama 2 and 3 (llama3 rope scaling included) and models of the same layout, such as SmolLM2."""

from replicas.model.registry import Architecture, register_architecture

register_architecture(
    Architecture(
        name="LlamaForCausalLM",
        hf_model_type="llama",
        gguf_name="llama",
        # llama.cpp's converter reorders Llama's q and k rows for its own rope; they are put back.
        gguf_interleaved_rotary=True,
    )
)
