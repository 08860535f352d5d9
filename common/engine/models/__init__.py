"""Model registry, keyed by the Hugging Face `architectures` name in config.json.

Values are "module:Class" strings imported on demand, so importing the registry is cheap.
"""

MODEL_REGISTRY = {
    "LlamaForCausalLM": "pdserve.common.engine.models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "pdserve.common.engine.models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "pdserve.common.engine.models.llama:LlamaForCausalLM",
    "Qwen3ForCausalLM": "pdserve.common.engine.models.llama:LlamaForCausalLM",
    "GPT2LMHeadModel": "pdserve.common.engine.models.gpt2:GPT2LMHeadModel",
}
