"""A vLLM worker extension for the tests: load a safetensors file the way verl's weight update
does (`model.load_weights` on HF-named tensors, then vLLM's `process_weights_after_loading`,
verl/workers/rollout/vllm_rollout/utils.py), without verl's transport."""


class LoadWeights:
    def load_safetensors(self, path: str) -> int:
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.utils import process_weights_after_loading

        model = self.model_runner.model
        named = list(load_file(path).items())
        model.load_weights(named)
        process_weights_after_loading(model, self.model_runner.vllm_config.model_config,
                                      self.device)  # fmt: skip
        return len(named)
